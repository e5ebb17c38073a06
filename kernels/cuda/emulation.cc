// RunGrid's lockstep block: one fiber per emulated thread, all switched on
// the calling host thread. Fibers rather than a host thread per emulated
// thread: a switch is a function call, not a trip through the OS scheduler
// (a reduction block is 256 threads passing 9 barriers); the interleaving is
// the same on every run, so a failure reproduces; a block's shared memory is
// simply a static; and the scheduler sees every thread's state, so a barrier
// that not every thread reaches is reported instead of hanging. Phase
// splitting (cutting the kernels at their barriers) would need the kernels'
// source changed.
//
// A fiber starts on its own stack through makecontext/setcontext; after that,
// switches are _setjmp/_longjmp, because swapcontext makes a sigprocmask
// syscall each way, which made the tests several times slower. glibc's
// fortified longjmp refuses to jump to another stack, hence the #undef,
// which must come before any header.
#undef _FORTIFY_SOURCE

#include "kernels/cuda/emulation.h"

#include <setjmp.h>
#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace shardopt::cuda::emulation {
namespace {

// The kernels keep a few hundred bytes of locals; this leaves room for
// unoptimized and sanitized builds.
constexpr size_t kStackBytes = size_t{64} << 10;
// The device's limits for a one-dimensional launch.
constexpr uint32_t kMaxThreadsPerBlock = 1024;
constexpr uint32_t kMaxBlocks = 0x7FFFFFFFu;

// A kernel or launch bug the device would report (or hang on): the test
// process stops here, saying which.
[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "cuda emulation: %s\n", what.c_str());
  std::abort();
}

enum class FiberState { kNew, kRunning, kAtBarrier, kDone };

struct Fiber {
  ucontext_t start;  // a new fiber: FiberMain on its own stack
  jmp_buf resume;    // a suspended one
  FiberState state;
};

struct Block {
  absl::FunctionRef<void()> thread;
  std::vector<Fiber> fibers;
  jmp_buf scheduler;
  uint32_t current = 0;
};

// The block being run on this host thread, for __syncthreads and the fibers.
thread_local Block* running = nullptr;

// Suspends the caller into `from` and resumes `to`; returns when something
// resumes `from`. Out of line, so that no caller's locals live across the
// double return of _setjmp.
[[gnu::noinline]] void Switch(jmp_buf from, jmp_buf to) {
  if (_setjmp(from) == 0) _longjmp(to, 1);
}
[[gnu::noinline]] void Start(jmp_buf from, const ucontext_t* to) {
  if (_setjmp(from) == 0) setcontext(to);
}

[[noreturn]] void FiberMain() {
  running->thread();
  running->fibers[running->current].state = FiberState::kDone;
  _longjmp(running->scheduler, 1);
}

// Fiber stacks, kept per host thread across launches. Left uninitialized,
// so that only the pages a fiber touches are ever mapped.
char* Stack(uint32_t thread) {
  thread_local std::vector<std::unique_ptr<char[]>> stacks;
  while (stacks.size() <= thread) stacks.emplace_back(new char[kStackBytes]);
  return stacks[thread].get();
}

void MakeFiber(Fiber& fiber, char* stack) {
  getcontext(&fiber.start);
  fiber.start.uc_stack.ss_sp = stack;
  fiber.start.uc_stack.ss_size = kStackBytes;
  fiber.start.uc_link = nullptr;  // FiberMain never returns
  makecontext(&fiber.start, FiberMain, 0);
  fiber.state = FiberState::kNew;
}

void RunBlock(Block& block, uint32_t index) {
  const uint32_t threads = static_cast<uint32_t>(block.fibers.size());
  for (uint32_t t = 0; t < threads; ++t) MakeFiber(block.fibers[t], Stack(t));
  for (;;) {
    uint32_t waiting = 0;
    for (uint32_t t = 0; t < threads; ++t) {
      Fiber& fiber = block.fibers[t];
      if (fiber.state == FiberState::kDone) continue;
      const bool fresh = fiber.state == FiberState::kNew;
      fiber.state = FiberState::kRunning;
      block.current = t;
      threadIdx = {t, 0, 0};
      if (fresh) {
        Start(block.scheduler, &fiber.start);
      } else {
        Switch(block.scheduler, fiber.resume);
      }
      waiting += fiber.state == FiberState::kAtBarrier;
    }
    if (waiting == 0) return;  // every thread has ended
    if (waiting != threads) {
      Fail(absl::StrCat("block ", index, ": ", threads - waiting, " of ", threads,
                        " threads ended while the others wait at __syncthreads"));
    }
  }
}

void Barrier() {
  if (running == nullptr) Fail("__syncthreads outside an emulated kernel");
  Fiber& fiber = running->fibers[running->current];
  fiber.state = FiberState::kAtBarrier;
  Switch(fiber.resume, running->scheduler);
}

}  // namespace

void RunGrid(uint32_t blocks, uint32_t threads, absl::FunctionRef<void()> thread) {
  if (blocks == 0 || blocks > kMaxBlocks || threads == 0 || threads > kMaxThreadsPerBlock) {
    Fail(absl::StrCat("a launch of ", blocks, " blocks of ", threads, " threads, which the device refuses"));
  }
  if (running != nullptr) Fail("a kernel launched from inside an emulated kernel");
  Block block{thread, std::vector<Fiber>(threads), {}, 0};
  gridDim = {blocks, 1, 1};
  blockDim = {threads, 1, 1};
  running = &block;
  for (uint32_t b = 0; b < blocks; ++b) {
    blockIdx = {b, 0, 0};
    RunBlock(block, b);
  }
  running = nullptr;
}

}  // namespace shardopt::cuda::emulation

void __syncthreads() { shardopt::cuda::emulation::Barrier(); }
