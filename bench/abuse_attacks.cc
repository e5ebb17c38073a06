#include "bench/abuse_attacks.h"

#include <atomic>
#include <thread>

#include "client/wire.h"
#include "grpcpp/generic/generic_stub.h"

namespace shardopt::bench {

grpc::Status Attacker::Create(const v1::CreateJobRequest& request) {
  v1::CreateJobResponse created;
  const grpc::Status st = stub_->CreateJob(Context(30).get(), request, &created);
  if (st.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(request.job());
  }
  return st;
}

std::vector<std::string> Attacker::jobs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return jobs_;
}

namespace {

using Clock = AbuseClock;

v1::CreateJobRequest CreateRequest(const std::string& name, uint32_t world, uint64_t tensors, uint64_t numel) {
  v1::CreateJobRequest r;
  r.set_job(name);
  r.set_world_size(world);
  v1::Group* g = r.add_groups();
  g->set_beta1(0.9);
  g->set_beta2(0.999);
  g->set_eps(1e-8f);
  for (uint64_t i = 0; i < tensors; ++i) {
    v1::TensorSpec* t = r.add_tensors();
    t->set_name(absl::StrCat("t", i));
    t->set_numel(numel);
  }
  return r;
}

// Runs `attack` on `threads` threads until `until`, each calling it in a loop.
void Loop(int threads, Clock::time_point until, const std::function<void(int)>& attack) {
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      while (Clock::now() < until) attack(t);
    });
  }
  for (auto& th : pool) th.join();
}

// Gives job `name` (one tensor "t0" of `numel`) its initial values, so that
// pushes to it get past their first checks.
void InitJob(Attacker& a, const std::string& name, uint64_t numel) {
  auto ctx = a.Context();
  v1::InitResponse resp;
  auto w = a.stub().Init(ctx.get(), &resp);
  v1::InitChunk c;
  c.set_job(name);
  c.set_tensor("t0");
  c.set_dtype(v1::FP32);
  c.set_kind(v1::MASTER);
  const std::vector<float> values(numel, 1.0f);
  c.set_data(values.data(), values.size() * 4);
  w->Write(c);
  w->WritesDone();
  w->Finish();
}

// Gives job `name`'s one-element tensors "t0".."t{tensors-1}" the initial
// value 1, in one Init stream.
grpc::Status InitOnes(Attacker& a, const std::string& name, int tensors) {
  auto ctx = a.Context(60);
  v1::InitResponse resp;
  auto w = a.stub().Init(ctx.get(), &resp);
  for (int i = 0; i < tensors; ++i) {
    v1::InitChunk c;
    c.set_job(name);
    c.set_tensor(absl::StrCat("t", i));
    c.set_dtype(v1::FP32);
    c.set_kind(v1::MASTER);
    const float one = 1;
    c.set_data(&one, 4);
    if (!w->Write(c)) break;
  }
  w->WritesDone();
  return w->Finish();
}

// The attacks: the six of the security review, and a flood of packed
// chunks (after an outside probe of packing). Each runs until `until`.
void NoGradFlood(Attacker& a, Answers& answers, Clock::time_point until) {
  // A push stream whose chunks name 60,000 tensors the job lacks, 100
  // characters each (6 MB a message): each is refused at its first name.
  answers.Add(a.Create(CreateRequest("attacker/nograd", 1, 1, 8)));
  InitJob(a, "attacker/nograd", 8);
  v1::GradChunk names;
  names.set_job("attacker/nograd");
  names.set_step(1);
  for (int i = 0; i < 60000; ++i) names.add_no_grad(absl::StrCat(i, std::string(94, 'x')).substr(0, 100));
  Loop(1, until, [&](int) {
    auto ctx = a.Context(30);
    v1::PushResponse resp;
    auto w = a.stub().Push(ctx.get(), &resp);
    for (int m = 0; m < 20 && w->Write(names); ++m) {
    }
    w->WritesDone();
    answers.Add(w->Finish());
  });
}

void PackedFlood(Attacker& a, Answers& answers, Clock::time_point until) {
  // A job of 16384 one-element tensors (--max_tensors_per_job's default),
  // and push messages that each pack a chunk of every one (GradChunk.more,
  // about 280 KB): the most a message may pack. Each packed chunk costs the
  // server about 210 B once read and is charged 256 B, 4 MiB a message.
  // Before the cap and the charge, 8 MB messages of empty packed chunks took
  // a server of 128 MiB to 419 MB. Two streams at once, the step pushed
  // again and again (its retries count once).
  constexpr int kTensors = 16384;
  answers.Add(a.Create(CreateRequest("attacker/packed", 1, kTensors, 1)));
  answers.Add(InitOnes(a, "attacker/packed", kTensors));
  v1::GradChunk head;
  head.set_job("attacker/packed");
  head.set_step(1);
  v1::GradChunk packed;
  const uint16_t one = 0x3f80;  // bf16 1.0
  for (int i = 0; i < kTensors; ++i) {
    v1::GradChunk* chunk = i == 0 ? &packed : packed.add_more();
    chunk->set_tensor(absl::StrCat("t", i));
    chunk->set_dtype(v1::BF16);
    chunk->set_data(&one, 2);
  }
  Loop(2, until, [&](int) {
    auto ctx = a.Context(30);
    v1::PushResponse resp;
    auto w = a.stub().Push(ctx.get(), &resp);
    bool open = w->Write(head);
    for (int m = 0; m < 20 && open; ++m) open = w->Write(packed);
    w->WritesDone();
    answers.Add(w->Finish());
  });
}

void BarrierTracking(Attacker& a, Answers& answers, Clock::time_point until) {
  // world_size 65536, 2000 one-element tensors; ranks push one element each
  // and wait at the barrier, listing the rest as no_grad.
  answers.Add(a.Create(CreateRequest("attacker/wide", 65536, 2000, 1)));
  InitOnes(a, "attacker/wide", 2000);
  // Each rank finishes its push and then goes away: a finished rank stays in
  // the round until its barrier deadline, with its tracking.
  std::atomic<uint32_t> next_rank{0};
  Loop(16, until, [&](int) {
    const uint32_t rank = next_rank++ % 65536;
    auto ctx = a.Context(1);
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
    v1::PushResponse resp;
    auto w = a.stub().Push(ctx.get(), &resp);
    v1::GradChunk c;
    c.set_job("attacker/wide");
    c.set_step(1);
    c.set_rank(rank);
    c.set_tensor("t0");
    c.set_dtype(v1::BF16);
    const uint16_t g = 0x3f80;
    c.set_data(&g, 2);
    for (int i = 1; i < 2000; ++i) c.add_no_grad(absl::StrCat("t", i));
    w->Write(c);
    w->WritesDone();
    answers.Add(w->Finish());
  });
}

void MemoryFill(Attacker& a, Answers& answers, Clock::time_point until) {
  // One tensor of 1.2e9 elements, then jobs of 16M params until refused.
  answers.Add(a.Create(CreateRequest("attacker/huge", 1, 1, 1200000000)));
  for (int i = 0; Clock::now() < until; ++i) {
    const std::string name = absl::StrCat("attacker/fill", i);
    const grpc::Status st = a.Create(CreateRequest(name, 1, 1, 16 << 20));
    answers.Add(st);
    if (!st.ok()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    // Touch the master so its pages are real.
    auto ctx = a.Context(60);
    v1::InitResponse resp;
    auto w = a.stub().Init(ctx.get(), &resp);
    std::vector<float> values(1 << 20, 0.5f);
    v1::InitChunk c;
    c.set_job(name);
    c.set_tensor("t0");
    c.set_dtype(v1::FP32);
    c.set_kind(v1::MASTER);
    for (uint64_t off = 0; off < (16 << 20) && Clock::now() < until; off += 1 << 20) {
      c.set_offset(off);
      c.set_data(values.data(), values.size() * 4);
      if (!w->Write(c)) break;
    }
    w->WritesDone();
    answers.Add(w->Finish());
  }
}

void HeldStreams(Attacker& a, Answers& answers, Clock::time_point until) {
  // Push and Init streams opened and never finished, as many as it can.
  struct Held {
    std::unique_ptr<grpc::ClientContext> ctx;
    v1::PushResponse push;
    v1::InitResponse init;
    std::unique_ptr<grpc::ClientWriter<v1::GradChunk>> pusher;
    std::unique_ptr<grpc::ClientWriter<v1::InitChunk>> initer;
  };
  std::vector<std::unique_ptr<Held>> held;
  for (int i = 0; i < 1500 && Clock::now() < until; ++i) {
    auto h = std::make_unique<Held>();
    h->ctx = a.Context();
    h->ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(1));
    if (i % 2 == 0) {
      h->pusher = a.stub().Push(h->ctx.get(), &h->push);
    } else {
      h->initer = a.stub().Init(h->ctx.get(), &h->init);
    }
    held.push_back(std::move(h));
  }
  std::this_thread::sleep_until(until);
  // The streams past the caps were refused at once; the ones held are
  // cancelled half a second later. Newest first: those are the refused.
  std::thread cancel([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    for (auto& h : held) h->ctx->TryCancel();
  });
  for (auto it = held.rbegin(); it != held.rend(); ++it) {
    answers.Add((*it)->pusher ? (*it)->pusher->Finish() : (*it)->initer->Finish());
  }
  cancel.join();
}

void Amplification(Attacker& a, Answers& answers, Clock::time_point until) {
  // CreateJob of 600K one-element tensors (6.5 MB): refused by the cap.
  const v1::CreateJobRequest wide = CreateRequest("attacker/amplify", 1, 600000, 1);
  Loop(1, until, [&](int) { answers.Add(a.Create(wide)); });
}

void TruncatedStreams(Attacker& a, Answers& answers, Clock::time_point until) {
  // Init streams with an unparseable message after a good one: raw bytes,
  // so that no serializer tidies them up.
  grpc::GenericStub generic(a.channel());
  answers.Add(a.Create(CreateRequest("attacker/cut", 1, 1, 8)));
  v1::InitChunk c;
  c.set_job("attacker/cut");
  c.set_tensor("t0");
  c.set_dtype(v1::FP32);
  c.set_kind(v1::MASTER);
  const float four[4] = {1, 2, 3, 4};
  c.set_data(four, sizeof four);
  const std::string good = c.SerializeAsString();
  const std::string garbage("\x0a\xff\xff\xff\xff\x0f", 6);  // a length past the message's end
  Loop(1, until, [&](int) {
    auto ctx = a.Context();
    wire::Stream stream(&generic, ctx.get(), "/shardopt.v1.Optimizer/Init");
    for (const std::string* m : {&good, &garbage}) {
      grpc::Slice slice(*m);
      stream.Write(grpc::ByteBuffer(&slice, 1));
    }
    stream.WritesDone();
    answers.Add(stream.Finish());
  });
}

}  // namespace

const std::vector<Attack>& Attacks() {
  static const auto* attacks = new std::vector<Attack>{
      {"no_grad_flood", NoGradFlood}, {"packed_flood", PackedFlood},         {"barrier_tracking", BarrierTracking},
      {"memory_fill", MemoryFill},    {"held_streams", HeldStreams},         {"amplification", Amplification},
      {"truncated_streams", TruncatedStreams},
  };
  return *attacks;
}

}  // namespace shardopt::bench
