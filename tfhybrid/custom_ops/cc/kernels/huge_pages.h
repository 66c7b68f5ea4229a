// Transparent huge pages for embedding tables.
//
// A lookup or an optimizer step touches rows scattered over a table of hundreds of MB:
// with 4 KiB pages nearly every row costs a TLB miss and a page walk, which is most of
// a lookup's time once tables outgrow the TLB's reach (measured in one run of
// benchmarks/optimizer_apply.py, 8 tables of 256 MB on 2 cores: 4 KiB pages made the
// forward 1.63x and the train step 1.13x slower than 2 MiB pages).
// TensorFlow's CPU allocator hands out memory with the kernel's default policy, which on
// most distributions ("madvise") means 4 KiB pages, and the table is already written by
// its initializer when a kernel first sees it. So the first kernel to touch a buffer of
// at least kHugePagesMinBytes asks the kernel to back its 2 MiB-aligned interior with
// huge pages (MADV_HUGEPAGE, then MADV_COLLAPSE, Linux >= 6.1, which converts the
// populated pages in place). This costs about as much as writing the buffer once, once
// per buffer; contents are unchanged. TFHYBRID_HUGE_PAGES=0 turns it off. Failures
// (THP disabled, an older kernel) leave the buffer as it was.
#ifndef TFHYBRID_CUSTOM_OPS_CC_KERNELS_HUGE_PAGES_H_
#define TFHYBRID_CUSTOM_OPS_CC_KERNELS_HUGE_PAGES_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <set>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace tensorflow {
namespace tfhybrid {

constexpr size_t kHugePageBytes = size_t{2} << 20;
// Below a few huge pages the TLB already covers the buffer.
constexpr size_t kHugePagesMinBytes = size_t{4} << 20;

// Read on every call (a scan of the environment, only for large buffers), so that a
// process may switch it while it runs.
inline bool HugePagesEnabled() {
  const char* v = std::getenv("TFHYBRID_HUGE_PAGES");
  return !(v != nullptr && v[0] == '0');
}

// Advises [data, data + bytes) once per distinct buffer (address and size).
inline void AdviseHugePages(const void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes < kHugePagesMinBytes || data == nullptr || !HugePagesEnabled()) return;
  // (a buffer skipped while disabled is advised on a later call once enabled)
  static std::mutex mu;
  static std::set<std::pair<uintptr_t, size_t>>* advised =
      new std::set<std::pair<uintptr_t, size_t>>();
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data);
  {
    std::lock_guard<std::mutex> lock(mu);
    // A bound on the bookkeeping: freed buffers' entries are never removed, and a
    // second advice of a live buffer is harmless.
    if (advised->size() > 4096) advised->clear();
    if (!advised->insert({begin, bytes}).second) return;
  }
  const uintptr_t first = (begin + kHugePageBytes - 1) & ~(kHugePageBytes - 1);
  const uintptr_t last = (begin + bytes) & ~(kHugePageBytes - 1);
  if (last <= first) return;
  void* aligned = reinterpret_cast<void*>(first);
  if (madvise(aligned, last - first, MADV_HUGEPAGE) != 0) return;
  constexpr int kMadvCollapse = 25;  // MADV_COLLAPSE; older headers lack the name
  madvise(aligned, last - first, kMadvCollapse);
#else
  (void)data;
  (void)bytes;
#endif
}

}  // namespace tfhybrid
}  // namespace tensorflow

#endif  // TFHYBRID_CUSTOM_OPS_CC_KERNELS_HUGE_PAGES_H_
