#include "client/wire.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "rpc/grpc_edge.h"
#include "shardopt/v1/optimizer.pb.h"

namespace shardopt::wire {

namespace v1 = ::shardopt::v1;


grpc::ByteBuffer HeadAndBorrowedBytes(const std::string& head, const void* bytes, size_t length) {
  grpc::Slice slices[2] = {grpc::Slice(head), grpc::Slice(bytes, length, grpc::Slice::STATIC_SLICE)};
  return grpc::ByteBuffer(slices, length > 0 ? 2 : 1);
}

StreamCall::Ready SendOnce::operator()(grpc::ByteBuffer* out) const {
  if (sent_) return StreamCall::Ready::kEnd;
  sent_ = true;
  *out = HeadAndBorrowedBytes(request_, nullptr, 0);
  return StreamCall::Ready::kMessage;
}

grpc::Status OneAnswer::operator()(grpc::ByteBuffer* message) const {
  if (++answers_ > 1) {
    return grpc::Status(grpc::StatusCode::INTERNAL, absl::StrCat("the server answered a ", what_, " twice"));
  }
  return ParseMessage(message, answer_, what_).ok()
             ? grpc::Status::OK
             : grpc::Status(grpc::StatusCode::INTERNAL, absl::StrCat("malformed ", what_, " response"));
}

grpc::Status OneAnswer::Ended(const grpc::Status& call) const {
  if (call.ok() && answers_ == 0) {
    return grpc::Status(grpc::StatusCode::INTERNAL, absl::StrCat("the server ended the ", what_, " without an answer"));
  }
  return call;
}

grpc::Status StreamCall::Run(grpc::GenericStub* stub, grpc::ClientContext* context, const std::string& method,
                             Next next, Wait wait, Received received) {
  StreamCall call(context, next, wait, received);
  stub->PrepareBidiStreamingCall(context, method, grpc::StubOptions(), &call);
  call.StartRead(&call.in_);
  call.AddHold();  // the caller's turn to write
  call.StartCall();
  call.WriteFromCaller();
  std::unique_lock<std::mutex> lock(call.mu_);
  for (;;) {
    call.cv_.wait(lock, [&] { return call.later_ || call.done_; });
    if (call.done_) break;
    call.later_ = false;
    lock.unlock();
    call.WriteFromCaller();
    lock.lock();
  }
  return call.refused_.ok() ? call.status_ : call.refused_;
}

void StreamCall::WriteFromCaller() {
  for (;;) {
    switch (next_(&out_)) {
      case Ready::kMessage:
        StartWrite(&out_);
        return RemoveHold();
      case Ready::kEnd:
        StartWritesDone();
        return RemoveHold();
      case Ready::kLater:
        wait_();
        break;
    }
  }
}

void StreamCall::OnWriteDone(bool ok) {
  if (!ok) return;  // the call has ended, and OnDone says how
  switch (next_(&out_)) {
    case Ready::kMessage:
      return StartWrite(&out_);
    case Ready::kEnd:
      return StartWritesDone();
    case Ready::kLater: {
      AddHold();  // released once the caller has started the write
      std::lock_guard<std::mutex> lock(mu_);
      later_ = true;
      cv_.notify_all();
    }
  }
}

void StreamCall::OnReadDone(bool ok) {
  if (!ok) return;
  if (grpc::Status st = received_(&in_); !st.ok()) {
    refused_ = st;
    return context_->TryCancel();
  }
  StartRead(&in_);
}

void StreamCall::OnDone(const grpc::Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  status_ = status;
  done_ = true;
  cv_.notify_all();
}

Stream::Stream(grpc::GenericStub* stub, grpc::ClientContext* context, const std::string& method)
    : call_(stub->PrepareCall(context, method, &queue_)) {
  call_->StartCall(this);
  started_ = Await();
}

Stream::~Stream() {
  if (!finished_) {
    grpc::Status ignored = Finish();
    (void)ignored;
  }
  queue_.Shutdown();
  void* tag;
  bool ok;
  while (queue_.Next(&tag, &ok)) {
  }
}

bool Stream::Await() {
  void* tag;
  bool ok = false;
  return queue_.Next(&tag, &ok) && ok;
}

bool Stream::Write(const grpc::ByteBuffer& message) {
  if (!started_) return false;
  call_->Write(message, this);
  return Await();
}

bool Stream::WritesDone() {
  if (!started_) return false;
  call_->WritesDone(this);
  return Await();
}

bool Stream::Read(grpc::ByteBuffer* message) {
  if (!started_) return false;
  call_->Read(message, this);
  return Await();
}

grpc::Status Stream::Finish() {
  grpc::Status status;
  finished_ = true;
  call_->Finish(&status, this);
  Await();
  return status;
}

std::string GradChunkHead(absl::string_view tensor, uint64_t offset, int dtype, uint64_t data_bytes) {
  std::string head;
  AppendBytesField(&head, v1::GradChunk::kTensorFieldNumber, tensor);
  AppendVarintField(&head, v1::GradChunk::kOffsetFieldNumber, offset);
  AppendVarintField(&head, v1::GradChunk::kDtypeFieldNumber, static_cast<uint64_t>(dtype));
  AppendBytesHeader(&head, v1::GradChunk::kDataFieldNumber, data_bytes);
  return head;
}

const ChunkFields kParamChunk{v1::ParamChunk::kTensorFieldNumber, v1::ParamChunk::kOffsetFieldNumber,
                               v1::ParamChunk::kDataFieldNumber, v1::ParamChunk::kStepFieldNumber,
                               v1::ParamChunk::kDtypeFieldNumber, v1::ParamChunk::kMoreFieldNumber};
const ChunkFields kStateChunk{v1::StateChunk::kTensorFieldNumber, v1::StateChunk::kOffsetFieldNumber,
                               v1::StateChunk::kDataFieldNumber, v1::StateChunk::kStepFieldNumber,
                               v1::StateChunk::kDtypeFieldNumber, 0};

namespace {

// One chunk of `bytes`; its packed chunks (fields.more) into `more`.
bool ReadOneChunk(const Pieces& bytes, const ChunkFields& fields, absl::FunctionRef<char*(const ChunkHead&)> place,
                  std::vector<Pieces>* more) {
  std::vector<Field> scanned;
  if (!ScanFields(bytes, &scanned)) return false;
  ChunkHead head;
  const Field* data = nullptr;
  for (const Field& f : scanned) {
    const Pieces value = bytes.Sub(f.value, f.end - f.value);
    if (f.wire_type == 0) {
      uint64_t v;
      if (!ReadVarint(value, &v)) return false;
      if (f.number == fields.offset) head.offset = v;
      if (f.number == fields.step) head.step = v;
      if (f.number == fields.dtype) head.dtype = v;
    } else if (f.wire_type == kLengthDelimited && f.number == fields.tensor) {
      head.tensor.resize(value.size());
      value.CopyTo(head.tensor.data());
    } else if (f.wire_type == kLengthDelimited && f.number == fields.data) {
      data = &f;  // the last one wins, as in protobuf
    } else if (f.wire_type == kLengthDelimited && fields.more != 0 && f.number == fields.more) {
      if (more == nullptr) return false;  // packed inside a packed chunk: never sent
      more->push_back(value);
    }
  }
  if (data == nullptr) return false;
  head.data_bytes = data->end - data->value;
  char* dst = place(head);
  if (dst == nullptr) return false;
  bytes.Sub(data->value, head.data_bytes).CopyTo(dst);
  return true;
}

}  // namespace

bool ReadChunks(grpc::ByteBuffer* message, const ChunkFields& fields,
                absl::FunctionRef<char*(const ChunkHead&)> place) {
  std::vector<grpc::Slice> slices;
  if (!message->Dump(&slices).ok()) return false;
  std::vector<absl::string_view> views;
  for (const grpc::Slice& s : slices) views.emplace_back(reinterpret_cast<const char*>(s.begin()), s.size());
  const Pieces bytes(std::move(views), nullptr);  // `slices` outlives it
  std::vector<Pieces> more;
  if (!ReadOneChunk(bytes, fields, place, &more)) return false;
  for (const Pieces& packed : more) {
    if (!ReadOneChunk(packed, fields, place, nullptr)) return false;
  }
  return true;
}

}  // namespace shardopt::wire
