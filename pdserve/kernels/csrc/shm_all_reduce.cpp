// The all-reduce of tensor-parallel ranks on one CPU host, through shared memory (vLLM's CPU build does the
// same): each rank copies its partial sum into its slot, raises its flag to the call's sequence number, waits
// until every rank's flag has reached it, then sums every slot in rank order (so all ranks get the same bits).
// Two slot sets alternate by the sequence number's parity: a rank that reached call n's flags knows every
// rank has finished reading call n - 1's slots, so no second barrier is needed. gloo over loopback sockets
// cost 60-100 us per call; this costs a copy, a flag and a sum.
//
// A wait spins briefly (the peers are on their own cores, a few microseconds behind) and then yields; while
// yielding it checks that every peer process and the parent (the engine) still exist, so a dead rank makes
// the others fail with an error instead of waiting forever.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <sched.h>
#include <signal.h>
#include <torch/library.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "vec.h"

using namespace pdserve;

namespace {

inline void cpu_relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

bool process_gone(int64_t pid) { return kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH; }

void wait_for_ranks(const int64_t* flags, int64_t stride, int64_t ranks, int64_t seq, const int64_t* pids,
                    int64_t parent) {
  constexpr int64_t kSpins = 1 << 14;
  for (int64_t r = 0; r < ranks; ++r) {
    const int64_t* flag = flags + r * stride;
    for (int64_t spins = 0; __atomic_load_n(flag, __ATOMIC_ACQUIRE) < seq; ++spins) {
      if (spins < kSpins) {
        cpu_relax();
        continue;
      }
      sched_yield();
      if ((spins & 255) == 0) {
        TORCH_CHECK(!process_gone(pids[r]), "tensor-parallel rank ", r, " (pid ", pids[r], ") is gone");
        TORCH_CHECK(getppid() == parent, "the engine that started this rank is gone");
      }
    }
  }
}

template <typename T>
void sum_slots(T* out, const uint8_t* base, int64_t capacity, int64_t ranks, int64_t n) {
  const int64_t grain = std::max<int64_t>(kLanes, 16384);
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + kLanes <= end; i += kLanes) {
      fvec acc = vload(reinterpret_cast<const T*>(base) + i);
      for (int64_t r = 1; r < ranks; ++r) acc += vload(reinterpret_cast<const T*>(base + r * capacity) + i);
      vstore(out + i, acc);
    }
    for (; i < end; ++i) {
      float acc = static_cast<float>(reinterpret_cast<const T*>(base)[i]);
      for (int64_t r = 1; r < ranks; ++r) acc += static_cast<float>(reinterpret_cast<const T*>(base + r * capacity)[i]);
      out[i] = static_cast<T>(acc);
    }
  });
}

}  // namespace

// x (this rank's partial sum, contiguous) becomes the sum over ranks. slots: uint8 [2, ranks, capacity] and
// flags: int64 [ranks, stride] in memory every rank maps; pids: int64 [ranks]; seq: this call's number (from 1).
void shm_all_reduce(const at::Tensor& x, const at::Tensor& slots, const at::Tensor& flags, const at::Tensor& pids,
                    int64_t rank, int64_t seq, int64_t parent) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu(), "x must be a contiguous CPU tensor");
  TORCH_CHECK(slots.dim() == 3 && slots.size(0) == 2 && slots.scalar_type() == at::kByte, "slots: uint8 [2, ranks, n]");
  const int64_t ranks = slots.size(1), capacity = slots.size(2);
  const int64_t bytes = x.numel() * x.element_size();
  TORCH_CHECK(bytes <= capacity, "the tensor (", bytes, " bytes) is larger than a slot (", capacity, ")");
  TORCH_CHECK(flags.scalar_type() == at::kLong && flags.size(0) == ranks, "flags: int64 [ranks, stride]");
  uint8_t* base = slots.data_ptr<uint8_t>() + (seq & 1) * ranks * capacity;
  std::memcpy(base + rank * capacity, x.data_ptr(), bytes);
  int64_t* f = flags.data_ptr<int64_t>();
  __atomic_store_n(f + rank * flags.stride(0), seq, __ATOMIC_RELEASE);
  wait_for_ranks(f, flags.stride(0), ranks, seq, pids.data_ptr<int64_t>(), parent);
  switch (x.scalar_type()) {
    case at::kFloat: return sum_slots(x.data_ptr<float>(), base, capacity, ranks, x.numel());
    case at::kBFloat16: return sum_slots(x.data_ptr<c10::BFloat16>(), base, capacity, ranks, x.numel());
    case at::kHalf: return sum_slots(x.data_ptr<c10::Half>(), base, capacity, ranks, x.numel());
    default: TORCH_CHECK(false, "shm_all_reduce takes float32, bfloat16 or float16, not ", x.scalar_type());
  }
}

// Rank 0's out [rows, ranks * cols] gets every rank's x [rows, cols] side by side (a vocabulary-parallel
// projection's logits); the other ranks only hand theirs over. The same slots and sequence numbers as the
// all-reduce: a rank reusing a slot two calls later has passed a barrier rank 0 reaches only after reading it.
void shm_gather(const at::Tensor& x, const at::Tensor& out, const at::Tensor& slots, const at::Tensor& flags,
                const at::Tensor& pids, int64_t rank, int64_t seq, int64_t parent) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2, "x must be a contiguous [rows, cols] tensor");
  const int64_t ranks = slots.size(1), capacity = slots.size(2);
  const int64_t bytes = x.numel() * x.element_size();
  TORCH_CHECK(bytes <= capacity, "the tensor (", bytes, " bytes) is larger than a slot (", capacity, ")");
  uint8_t* base = slots.data_ptr<uint8_t>() + (seq & 1) * ranks * capacity;
  std::memcpy(base + rank * capacity, x.data_ptr(), bytes);
  int64_t* f = flags.data_ptr<int64_t>();
  __atomic_store_n(f + rank * flags.stride(0), seq, __ATOMIC_RELEASE);
  if (rank != 0) return;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == ranks * x.size(1) && out.stride(1) == 1 &&
                  out.scalar_type() == x.scalar_type(), "out must be [rows, ranks * cols] of x's dtype");
  wait_for_ranks(f, flags.stride(0), ranks, seq, pids.data_ptr<int64_t>(), parent);
  const int64_t rows = x.size(0), row_bytes = x.size(1) * x.element_size();
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  const int64_t out_row_bytes = out.stride(0) * out.element_size();
  at::parallel_for(0, ranks * rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / rows, row = i % rows;
      std::memcpy(dst + row * out_row_bytes + r * row_bytes, base + r * capacity + row * row_bytes, row_bytes);
    }
  });
}

TORCH_LIBRARY_FRAGMENT(pdserve_kernels, m) {
  m.def("shm_all_reduce(Tensor(a!) x, Tensor slots, Tensor flags, Tensor pids, int rank, int seq, int parent) -> ()");
  m.def("shm_gather(Tensor x, Tensor(a!) out, Tensor slots, Tensor flags, Tensor pids, int rank, int seq, "
        "int parent) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_kernels, CPU, m) {
  m.impl("shm_all_reduce", &shm_all_reduce);
  m.impl("shm_gather", &shm_gather);
}
