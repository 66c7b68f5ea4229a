// CPU kernels of dynamic tables (tfhybrid/dynamic/): DynamicFindOrInsert, one shard's
// batched find-or-insert of keys, with admission, eviction and expiry, which also writes
// the new keys' initial rows and zero accumulators; and DynamicKeyedRows, the initial
// rows of keys alone.
//
// A shard has `capacity` slots. Its state is variables, so that checkpoints, broadcasts
// and replicas see it like any other: per slot its key, the call that last saw it (-1: a
// free slot) and its sightings; an open-addressing index over a power-of-two number of
// buckets (at least twice the slots; a bucket holds a slot or -1), probed linearly from
// the top bits of mix64(key) (the owner of a key in its model group is mix64 mod M, the
// low bits: the top bits stay spread inside one shard); the same for the admission
// candidates; and counters. One call, on one list of keys:
//
//   1. each key is looked up: a key held by a slot is a hit, the slot is seen now and its
//      sightings grow (per occurrence);
//   2. the missing keys, sorted, with how often each occurs in the call;
//   3. with ttl > 0, slots unseen for more than ttl calls are freed (expired);
//   4. a missing key is admitted at once (admit_after 1) or counted as a candidate until
//      its sightings reach admit_after (candidates are bounded by their arrays: when
//      they are full, the least recently seen, then the smallest key, makes room);
//   5. admitted keys, in key order, take free slots (lowest first), then never used ones,
//      then the slots of evicted rows: with evict lfu the fewest sightings (then least
//      recently seen, then smallest key), with lru the least recently seen (then fewest
//      sightings, then smallest key), never a slot seen in the last `pinned` calls; with
//      evict none, or no slot to evict, a key is refused (it reads the default row);
//   6. the slots that took a new key get the key's initial row (initial_rows.py's
//      formula) and a zero accumulator; every input key's slot is returned (-1: not
//      admitted), and the slots that took a new key with those keys.
//
// With insert false (inference) a call only finds: the state is not touched.
//
// The result depends on nothing but the state and the list of keys, so the replicas of a
// shard, called with the same keys, stay identical slot for slot.

#define EIGEN_USE_THREADS

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <tuple>
#include <utility>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/kernels/training_op_helpers.h"
#include "tensorflow/core/util/work_sharder.h"
#include "huge_pages.h"
#include "isa_kernels.h"

namespace tensorflow {
namespace tfhybrid {

using CPUDevice = Eigen::ThreadPoolDevice;

// splitmix64's finalizer: tfhybrid/dynamic/keys.py's mix64.
inline uint64 Mix64(uint64 z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Where the counters live in their variable.
enum Counter : int {
  kAdmissions = 0,
  kEvictions = 1,     // rows evicted to make room, and rows expired (ttl)
  kRefusals = 2,      // sightings of keys that found no slot
  kHits = 3,          // sightings of keys held by a slot
  kMisses = 4,        // sightings of keys not held
  kLive = 5,          // slots holding a key
  kNextFresh = 6,     // slots [next_fresh, capacity) were never used
  kCandidates = 7,    // candidates held
  kNumCounters = 8,
};

// Open addressing with linear probing over `keys` (slot -> key); buckets hold slots.
class SlotIndex {
 public:
  SlotIndex(int32* buckets, int64 num_buckets, const int64* keys)
      : buckets_(buckets), mask_(num_buckets - 1), keys_(keys) {
    int bits = 0;
    while ((int64{1} << bits) < num_buckets) ++bits;
    shift_ = 64 - bits;
  }

  int32 Find(int64 key) const {
    for (int64 b = Home(key);; b = (b + 1) & mask_) {
      const int32 s = buckets_[b];
      if (s < 0) return -1;
      if (keys_[s] == key) return s;
    }
  }

  // The two dependent loads of a Find, ahead of it: the key's home bucket, then (once
  // that has arrived) the slot it names, whose key, last call and sightings are read.
  void PrefetchBucket(int64 key) const { __builtin_prefetch(&buckets_[Home(key)], 0, 3); }

  int32 FirstSlot(int64 key) const { return buckets_[Home(key)]; }

  void Insert(int64 key, int32 slot) {
    int64 b = Home(key);
    while (buckets_[b] >= 0) b = (b + 1) & mask_;
    buckets_[b] = slot;
  }

  // Removes `key` (its slot still holds it), shifting later entries of its run back so
  // that no lookup stops early at the hole.
  void Erase(int64 key) {
    int64 hole = Home(key);
    for (;; hole = (hole + 1) & mask_) {
      const int32 s = buckets_[hole];
      if (s < 0) return;
      if (keys_[s] == key) break;
    }
    for (int64 j = (hole + 1) & mask_;; j = (j + 1) & mask_) {
      const int32 s = buckets_[j];
      if (s < 0) break;
      const int64 home = Home(keys_[s]);
      // s may stay at j only if its home lies cyclically in (hole, j]
      const bool stays = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
      if (!stays) {
        buckets_[hole] = s;
        hole = j;
      }
    }
    buckets_[hole] = -1;
  }

 private:
  int64 Home(int64 key) const {
    if (shift_ >= 64) return 0;
    return static_cast<int64>(Mix64(static_cast<uint64>(key)) >> shift_);
  }

  int32* buckets_;
  int64 mask_;
  int shift_;
  const int64* keys_;
};

// One table of keys (the slots, or the candidates): key, last call seen, sightings
// (int32, saturating: past 2**31 - 1 sightings a key is as frequent as it gets, and four
// bytes a slot less keep a slot's bookkeeping within 32 bytes).
struct KeyArrays {
  int64* keys;
  int64* seen;
  int32* count;
  int64 size;
};

inline int32 Saturated(int64 count) {
  return count > int64{INT32_MAX} ? INT32_MAX : static_cast<int32>(count);
}

Status CheckIndex(const Tensor& index_t, int64 size, const char* what) {
  const int64 buckets = index_t.NumElements();
  if (buckets < 2 * size || (buckets & (buckets - 1)) != 0) {
    return errors::InvalidArgument(what, " index must have a power-of-two number of buckets, "
                                   "at least twice its ", size, " entries; got ", buckets);
  }
  return OkStatus();
}

// Sorts keys ascending. A call's missing keys are thousands: a radix sort (LSD, 11-bit
// digits of the key with its sign bit flipped, so that unsigned order is the keys'
// order; a digit all keys share is skipped) takes a few passes over them where
// std::sort's comparisons mispredict.
void SortKeys(std::vector<int64>* keys) {
  const size_t n = keys->size();
  if (n < 512) {
    std::sort(keys->begin(), keys->end());
    return;
  }
  constexpr int kBits = 11, kPasses = 6;
  constexpr uint64 kDigits = uint64{1} << kBits, kSign = uint64{1} << 63;
  std::vector<uint64> a(n), b(n);
  std::vector<uint32> count(kPasses * kDigits, 0);
  for (size_t i = 0; i < n; ++i) {
    a[i] = static_cast<uint64>((*keys)[i]) ^ kSign;
    for (int p = 0; p < kPasses; ++p) {
      ++count[p * kDigits + ((a[i] >> (p * kBits)) & (kDigits - 1))];
    }
  }
  for (int p = 0; p < kPasses; ++p) {
    uint32* c = &count[p * kDigits];
    if (c[(a[0] >> (p * kBits)) & (kDigits - 1)] == n) continue;
    uint32 sum = 0;
    for (uint64 d = 0; d < kDigits; ++d) {
      const uint32 here = c[d];
      c[d] = sum;
      sum += here;
    }
    for (size_t i = 0; i < n; ++i) b[c[(a[i] >> (p * kBits)) & (kDigits - 1)]++] = a[i];
    a.swap(b);
  }
  for (size_t i = 0; i < n; ++i) (*keys)[i] = static_cast<int64>(a[i] ^ kSign);
}

// The initial rows of keys: tfhybrid/dynamic/initial_rows.py's formula (its pure-TF
// KeyedInitializer.rows is the reference; tests hold the two together).
class KeyedRows {
 public:
  enum Kind { kConstant, kUniform, kNormal };

  static Status KindOf(const std::string& name, Kind* kind) {
    if (name == "constant" || name == "uniform" || name == "normal") {
      *kind = name == "constant" ? kConstant : name == "uniform" ? kUniform : kNormal;
      return OkStatus();
    }
    return errors::InvalidArgument("unknown initializer kind '", name, "'");
  }

  // seed_t: the table seed's 64 bits (scalar); bounds_t: [low, high] in float64
  static Status Of(Kind kind, int64 dim, const Tensor& seed_t, const Tensor& bounds_t,
                   KeyedRows* out) {
    if (!TensorShapeUtils::IsScalar(seed_t.shape()) || bounds_t.NumElements() != 2) {
      return errors::InvalidArgument("seed must be a scalar and bounds [low, high]");
    }
    out->kind_ = kind;
    out->dim_ = dim;
    out->low_ = bounds_t.flat<double>()(0);
    out->high_ = bounds_t.flat<double>()(1);
    out->seed_word_ = Mix64(static_cast<uint64>(seed_t.scalar<int64>()()) + kGolden);
    if (kind == kUniform) {
      KernelIsa isa;
      std::string error;
      if (!ActiveKernelIsa(&isa, &error)) return errors::InvalidArgument(error);
      out->uniform_ = KeyedUniformKernel(isa);
    }
    return OkStatus();
  }

  // Writes key i's row to row_of(i), for i in [0, n), sharded over the workers.
  template <typename RowOf>
  void Fill(OpKernelContext* ctx, const int64* keys, int64 n, RowOf row_of) const {
    const auto& workers = *ctx->device()->tensorflow_cpu_worker_threads();
    const int64 cost = kind_ == kNormal ? dim_ * 60 : dim_ * 4;
    Shard(workers.num_threads, workers.workers, n, cost, [&](int64 begin, int64 end) {
      for (int64 i = begin; i < end; ++i) Row(keys[i], row_of(i));
    });
  }

 private:
  static constexpr uint64 kGolden = 0x9E3779B97F4A7C15ULL;
  // 2 pi, as Python's 2.0 * math.pi
  static constexpr double kTwoPi = 6.283185307179586;

  // u(k, j): the top 53 bits of draw j + 1 of the key's stream, in [0, 1)
  static double Uniform(uint64 state, int64 j) {
    const uint64 bits = Mix64(state + static_cast<uint64>(j + 1) * kGolden);
    return static_cast<double>(bits >> 11) * 0x1.0p-53;
  }

  void Row(int64 key, float* row) const {
    if (kind_ == kConstant) {
      std::fill(row, row + dim_, static_cast<float>(low_));
      return;
    }
    const uint64 state = Mix64(static_cast<uint64>(key) ^ seed_word_);
    if (kind_ == kUniform) {
      // the dispatched loop (AVX-512 multiplies 64-bit words in its vectors)
      const KeyedUniformArgs args{&state, dim_, low_, high_ - low_, row};
      uniform_(args, 0, 1);
      return;
    }
    for (int64 j = 0; j < dim_; ++j) {
      const double u0 = Uniform(state, 2 * j);
      const double u1 = Uniform(state, 2 * j + 1);
      const double radius = std::sqrt(-2.0 * std::log1p(-u0));
      row[j] = static_cast<float>(low_ + high_ * radius * std::cos(kTwoPi * u1));
    }
  }

  Kind kind_ = kConstant;
  int64 dim_ = 1;
  double low_ = 0.0, high_ = 0.0;
  uint64 seed_word_ = 0;
  KeyedUniformFn uniform_ = nullptr;
};

class DynamicFindOrInsertOp : public OpKernel {
 public:
  explicit DynamicFindOrInsertOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("admit_after", &admit_after_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("ttl", &ttl_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("pinned", &pinned_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("insert", &insert_));
    std::string evict;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("evict", &evict));
    evict_ = evict == "lfu" ? kLfu : evict == "lru" ? kLru : kNone;
    std::string init;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("init", &init));
    OP_REQUIRES_OK(ctx, KeyedRows::KindOf(init, &init_));
  }

  void Compute(OpKernelContext* ctx) override {
    // inputs 0..8: slot_keys, slot_seen, slot_count, index, cand_keys, cand_seen,
    // cand_count, cand_index, counters; 9, 10: rows, accumulator (variables); 11: keys;
    // 12: call; 13, 14: the initializer's seed and bounds
    std::vector<int> variables = {0, 1, 2, 3, 4, 5, 6, 7, 8};
    if (insert_) {
      // the rows and accumulator are written at a few slots, as scatter updates and the
      // optimizer's kernels write them: in copy-on-read mode, set before the locks
      for (int i : {kRows, kAccumulator}) {
        core::RefCountPtr<Var> var;
        OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, i), &var));
        OP_REQUIRES(ctx, var->tensor()->dtype() == DT_FLOAT,
                    errors::InvalidArgument("rows and accumulator must be float32"));
        OP_REQUIRES_OK(ctx, EnsureSparseVariableAccess<CPUDevice, float>(ctx, var.get()));
        variables.push_back(i);
      }
    }
    auto locks = MaybeLockVariableInputMutexesInOrder<CPUDevice, int64>(
        ctx, /*do_lock=*/true, /*sparse=*/false, variables);
    Tensor t[9];
    for (int i : {0, 1, 4, 5, 8}) {
      OP_REQUIRES_OK(ctx, GetInputTensorFromVariable<CPUDevice, int64>(ctx, i, true, false,
                                                                         &t[i]));
    }
    for (int i : {2, 3, 6, 7}) {
      OP_REQUIRES_OK(ctx, GetInputTensorFromVariable<CPUDevice, int32>(ctx, i, true, false,
                                                                         &t[i]));
    }
    const int64 capacity = t[0].NumElements();
    OP_REQUIRES(ctx, capacity > 0 && capacity < (int64{1} << 31) &&
                         t[1].NumElements() == capacity && t[2].NumElements() == capacity,
                errors::InvalidArgument("slot_keys, slot_seen and slot_count must have one "
                                        "entry per slot (1 to 2**31 - 1); got ",
                                        capacity, ", ", t[1].NumElements(), " and ",
                                        t[2].NumElements()));
    OP_REQUIRES_OK(ctx, CheckIndex(t[3], capacity, "the slots'"));
    const int64 cand_size = t[4].NumElements();
    OP_REQUIRES(ctx, t[5].NumElements() == cand_size && t[6].NumElements() == cand_size &&
                         cand_size < (int64{1} << 31),
                errors::InvalidArgument("cand_keys, cand_seen and cand_count must have the "
                                        "same size"));
    if (admit_after_ > 1) {
      OP_REQUIRES(ctx, cand_size > 0,
                  errors::InvalidArgument("admit_after ", admit_after_, " needs candidates"));
      OP_REQUIRES_OK(ctx, CheckIndex(t[7], cand_size, "the candidates'"));
    }
    OP_REQUIRES(ctx, t[8].NumElements() == kNumCounters,
                errors::InvalidArgument("counters must have ", kNumCounters, " entries"));
    const Tensor& keys_t = ctx->input(11);
    const Tensor& call_t = ctx->input(12);
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(call_t.shape()),
                errors::InvalidArgument("call must be a scalar"));
    const int64 call = call_t.scalar<int64>()();
    OP_REQUIRES(ctx, call >= 0, errors::InvalidArgument("call must be >= 0, got ", call));
    // the rows new keys get, and their accumulators (read, and checked, before any state
    // changes)
    Tensor rows_t, accum_t;
    KeyedRows init;
    int64 dim = 0;
    if (insert_) {
      OP_REQUIRES_OK(ctx, GetInputTensorFromVariable<CPUDevice, float>(
                              ctx, kRows, /*lock_held=*/true, /*sparse=*/true, &rows_t));
      OP_REQUIRES_OK(ctx, GetInputTensorFromVariable<CPUDevice, float>(
                              ctx, kAccumulator, /*lock_held=*/true, /*sparse=*/true,
                              &accum_t));
      OP_REQUIRES(ctx, rows_t.dims() == 2 && rows_t.dim_size(0) == capacity &&
                           rows_t.dim_size(1) > 0 && accum_t.NumElements() == capacity,
                  errors::InvalidArgument("rows must be [", capacity, ", dim] and the "
                                          "accumulator [", capacity, "]; got ",
                                          rows_t.shape().DebugString(), " and ",
                                          accum_t.shape().DebugString()));
      dim = rows_t.dim_size(1);
      OP_REQUIRES_OK(ctx, KeyedRows::Of(init_, dim, ctx->input(13), ctx->input(14), &init));
    }

    // the index and the slots' arrays are read at random, a key at a time (huge_pages.h)
    for (int i : {0, 1, 2, 3}) AdviseHugePages(t[i].tensor_data().data(), t[i].TotalBytes());
    KeyArrays slots{t[0].flat<int64>().data(), t[1].flat<int64>().data(),
                    t[2].flat<int32>().data(), capacity};
    KeyArrays cands{t[4].flat<int64>().data(), t[5].flat<int64>().data(),
                    t[6].flat<int32>().data(), cand_size};
    int64* counters = t[8].flat<int64>().data();
    SlotIndex index(t[3].flat<int32>().data(), t[3].NumElements(), slots.keys);

    // the slot of every input key, filled as it is found or placed
    const int64 n = keys_t.NumElements();
    const int64* keys = keys_t.flat<int64>().data();
    Tensor* slots_out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, keys_t.shape(), &slots_out));
    int32* out = slots_out->flat<int32>().data();

    // 1-2. each occurrence probes the index: a hit is seen now and counted (without
    // insert only found, the state untouched); the missing occurrences' keys, sorted,
    // give the distinct missing keys and how often each occurs
    std::vector<int64> missing_at;   // positions
    // A probe costs two cache misses in a large shard (its bucket, then its slot's
    // key): prefetched kBucketAhead and kSlotAhead keys ahead, the misses of several
    // keys overlap instead of following each other. (On the benchmark's 8 shards of 1M
    // slots, 48 / 24 took 8% less CPU time in the find-or-insert than 16 / 8.)
    constexpr int64 kBucketAhead = 48, kSlotAhead = 24;
    for (int64 k = 0; k < n; ++k) {
      if (k + kBucketAhead < n) index.PrefetchBucket(keys[k + kBucketAhead]);
      if (k + kSlotAhead < n) {
        const int32 ahead = index.FirstSlot(keys[k + kSlotAhead]);
        if (ahead >= 0) {
          __builtin_prefetch(&slots.keys[ahead], 0, 3);
          if (insert_) {
            __builtin_prefetch(&slots.seen[ahead], 1, 3);
            __builtin_prefetch(&slots.count[ahead], 1, 3);
          }
        }
      }
      const int32 s = index.Find(keys[k]);
      out[k] = s;
      if (!insert_) continue;
      if (s >= 0) {
        slots.seen[s] = call;
        slots.count[s] = Saturated(int64{slots.count[s]} + 1);
      } else {
        missing_at.push_back(k);
      }
    }
    if (!insert_) {
      Tensor* none = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({0}), &none));
      OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({0}), &none));
      return;
    }
    const int64 misses = static_cast<int64>(missing_at.size());
    counters[kHits] += n - misses;
    counters[kMisses] += misses;
    std::vector<int64> sorted(misses);
    for (int64 m = 0; m < misses; ++m) sorted[m] = keys[missing_at[m]];
    SortKeys(&sorted);
    std::vector<int64> distinct, occurs;
    for (int64 m = 0; m < misses; ++m) {
      if (m == 0 || sorted[m] != sorted[m - 1]) {
        distinct.push_back(sorted[m]);
        occurs.push_back(0);
      }
      ++occurs.back();
    }
    const int64 u = static_cast<int64>(distinct.size());
    std::vector<int64> missing(u);
    std::iota(missing.begin(), missing.end(), int64{0});

    // 3. expiry, and the free slots (holes below next_fresh)
    std::vector<int32> free_slots;
    const int64 next_fresh = counters[kNextFresh];
    if (insert_ && (ttl_ > 0 || counters[kLive] < next_fresh)) {
      for (int64 s = 0; s < next_fresh; ++s) {
        if (slots.seen[s] >= 0 && ttl_ > 0 && call - slots.seen[s] > ttl_) {
          index.Erase(slots.keys[s]);
          slots.seen[s] = -1;
          slots.count[s] = 0;
          --counters[kLive];
          ++counters[kEvictions];
        }
        if (slots.seen[s] < 0) free_slots.push_back(static_cast<int32>(s));
      }
    }

    // 4. admission
    std::vector<int64> admit;   // indices into distinct, in key order
    std::vector<int64> admit_count;
    if (admit_after_ <= 1) {
      admit = missing;
      for (int64 i : missing) admit_count.push_back(occurs[i]);
    } else {
      Admit(missing, distinct, occurs, call, &cands, t[7].flat<int32>().data(),
            t[7].NumElements(), counters, &admit, &admit_count);
    }

    // 5. placement: free slots, fresh slots, then evicted ones
    const int64 fresh = capacity - counters[kNextFresh];
    const int64 available = static_cast<int64>(free_slots.size()) + fresh;
    std::vector<int32> victims;
    const int64 need = static_cast<int64>(admit.size());
    if (need > available && evict_ != kNone) {
      victims = Victims(slots, counters[kNextFresh], call, need - available);
    }
    std::vector<int32> new_slots;
    std::vector<int64> new_keys;
    size_t next_free = 0, next_victim = 0;
    constexpr int64 kInsertAhead = 32;   // the new keys' home buckets, prefetched
    for (int64 a = 0; a < need; ++a) {
      if (a + kInsertAhead < need) index.PrefetchBucket(distinct[admit[a + kInsertAhead]]);
      const int64 i = admit[a];
      int32 s;
      if (next_free < free_slots.size()) {
        s = free_slots[next_free++];
      } else if (counters[kNextFresh] < capacity) {
        s = static_cast<int32>(counters[kNextFresh]++);
      } else if (next_victim < victims.size()) {
        s = victims[next_victim++];
        index.Erase(slots.keys[s]);
        --counters[kLive];
        ++counters[kEvictions];
      } else {
        counters[kRefusals] += occurs[i];
        continue;
      }
      slots.keys[s] = distinct[i];
      slots.seen[s] = call;
      slots.count[s] = Saturated(admit_count[a]);
      index.Insert(distinct[i], s);
      ++counters[kLive];
      ++counters[kAdmissions];
      new_slots.push_back(s);
      new_keys.push_back(distinct[i]);
    }

    // 6. the new slots' initial rows and zero accumulators; the missing occurrences'
    // slots (-1: not admitted), found again now that the admitted keys are in
    const int64 added = static_cast<int64>(new_slots.size());
    if (added > 0) {
      float* rows = rows_t.flat<float>().data();
      float* accum = accum_t.flat<float>().data();
      const int32* at = new_slots.data();
      init.Fill(ctx, new_keys.data(), added, [rows, dim, at](int64 i) {
        return rows + static_cast<int64>(at[i]) * dim;
      });
      for (int32 s : new_slots) accum[s] = 0.0f;
    }
    for (int64 m = 0; m < misses; ++m) {
      if (m + kInsertAhead < misses) index.PrefetchBucket(keys[missing_at[m + kInsertAhead]]);
      out[missing_at[m]] = index.Find(keys[missing_at[m]]);
    }
    Tensor* new_slots_out = nullptr;
    Tensor* new_keys_out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({added}), &new_slots_out));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({added}), &new_keys_out));
    std::copy(new_slots.begin(), new_slots.end(), new_slots_out->flat<int32>().data());
    std::copy(new_keys.begin(), new_keys.end(), new_keys_out->flat<int64>().data());
  }

 private:
  enum Evict { kLfu, kLru, kNone };
  static constexpr int kRows = 9, kAccumulator = 10;

  // Step 4 with admit_after > 1: counts the missing keys as candidates; those whose
  // sightings reach admit_after leave the candidates to be admitted.
  void Admit(const std::vector<int64>& missing, const std::vector<int64>& distinct,
             const std::vector<int64>& occurs, int64 call, KeyArrays* cands,
             int32* cand_buckets, int64 cand_num_buckets, int64* counters,
             std::vector<int64>* admit, std::vector<int64>* admit_count) const {
    SlotIndex index(cand_buckets, cand_num_buckets, cands->keys);
    // first the keys that are candidates already: seen now, so none of them makes room
    std::vector<int32> cand_of(missing.size(), -1);
    std::vector<size_t> unlisted;
    for (size_t m = 0; m < missing.size(); ++m) {
      const int64 i = missing[m];
      const int32 c = index.Find(distinct[i]);
      if (c >= 0) {
        cands->seen[c] = call;
        cands->count[c] = Saturated(cands->count[c] + occurs[i]);
        cand_of[m] = c;
      } else {
        unlisted.push_back(m);
      }
    }
    if (!unlisted.empty()) {
      // positions without a candidate, lowest first, then those whose candidate may make
      // room (not seen in this call), least recently seen first, then smallest key
      std::vector<int32> open, replaceable;
      for (int64 p = 0; p < cands->size; ++p) {
        if (cands->seen[p] < 0) {
          open.push_back(static_cast<int32>(p));
        } else if (cands->seen[p] < call) {
          replaceable.push_back(static_cast<int32>(p));
        }
      }
      std::sort(replaceable.begin(), replaceable.end(), [cands](int32 a, int32 b) {
        return std::make_pair(cands->seen[a], cands->keys[a]) <
               std::make_pair(cands->seen[b], cands->keys[b]);
      });
      size_t next_open = 0, next_replaceable = 0;
      for (size_t m : unlisted) {
        const int64 i = missing[m];
        int32 c;
        if (next_open < open.size()) {
          c = open[next_open++];
          ++counters[kCandidates];
        } else if (next_replaceable < replaceable.size()) {
          c = replaceable[next_replaceable++];
          index.Erase(cands->keys[c]);
        } else {
          continue;   // every candidate was seen in this call: this key waits
        }
        cands->keys[c] = distinct[i];
        cands->seen[c] = call;
        cands->count[c] = Saturated(occurs[i]);
        index.Insert(distinct[i], c);
        cand_of[m] = c;
      }
    }
    // then, in key order, those whose sightings reach admit_after are admitted
    for (size_t m = 0; m < missing.size(); ++m) {
      const int32 c = cand_of[m];
      if (c < 0 || cands->count[c] < admit_after_) continue;
      admit->push_back(missing[m]);
      admit_count->push_back(cands->count[c]);
      index.Erase(cands->keys[c]);
      cands->seen[c] = -1;
      cands->count[c] = 0;
      --counters[kCandidates];
    }
  }

  // Step 5's victims: `wanted` slots below next_fresh not seen in the last `pinned`
  // calls, in eviction order.
  std::vector<int32> Victims(const KeyArrays& slots, int64 next_fresh, int64 call,
                             int64 wanted) const {
    std::vector<int32> eligible;
    for (int64 s = 0; s < next_fresh; ++s) {
      if (slots.seen[s] >= 0 && slots.seen[s] <= call - pinned_) {
        eligible.push_back(static_cast<int32>(s));
      }
    }
    const bool lfu = evict_ == kLfu;
    auto before = [&slots, lfu](int32 a, int32 b) {
      const int64 a1 = lfu ? slots.count[a] : slots.seen[a];
      const int64 b1 = lfu ? slots.count[b] : slots.seen[b];
      const int64 a2 = lfu ? slots.seen[a] : slots.count[a];
      const int64 b2 = lfu ? slots.seen[b] : slots.count[b];
      return std::make_tuple(a1, a2, slots.keys[a]) < std::make_tuple(b1, b2, slots.keys[b]);
    };
    if (static_cast<int64>(eligible.size()) > wanted) {
      std::nth_element(eligible.begin(), eligible.begin() + wanted, eligible.end(), before);
      eligible.resize(wanted);
    }
    std::sort(eligible.begin(), eligible.end(), before);
    return eligible;
  }

  int64 admit_after_;
  int64 ttl_;
  int64 pinned_;
  bool insert_;
  Evict evict_;
  KeyedRows::Kind init_;
};

// DynamicHeldSlots: the slots >= 0 of each bag, in order, and how many each bag keeps
// (tfhybrid.combiners.kept_in_bags with slots >= 0, its pure-TF form).
class DynamicHeldSlotsOp : public OpKernel {
 public:
  explicit DynamicHeldSlotsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& slots_t = ctx->input(0);
    const Tensor& lengths_t = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(slots_t.shape()) &&
                         TensorShapeUtils::IsVector(lengths_t.shape()),
                errors::InvalidArgument("slots and lengths must be vectors"));
    const int32* slots = slots_t.flat<int32>().data();
    const int64* lengths = lengths_t.flat<int64>().data();
    const int64 n = slots_t.NumElements();
    const int64 bags = lengths_t.NumElements();
    Tensor* per_bag_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, lengths_t.shape(), &per_bag_t));
    int64* per_bag = per_bag_t->flat<int64>().data();
    int64 total = 0, held = 0;
    for (int64 b = 0; b < bags; ++b) {
      OP_REQUIRES(ctx, lengths[b] >= 0 && total + lengths[b] <= n,
                  errors::InvalidArgument("bag lengths must be >= 0 and sum to the ", n,
                                          " slots; bag ", b, " has ", lengths[b]));
      int64 kept = 0;
      for (int64 i = total; i < total + lengths[b]; ++i) kept += slots[i] >= 0;
      per_bag[b] = kept;
      held += kept;
      total += lengths[b];
    }
    OP_REQUIRES(ctx, total == n,
                errors::InvalidArgument("bag lengths sum to ", total, ", not the ", n,
                                        " slots"));
    Tensor* held_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({held}), &held_t));
    int32* out = held_t->flat<int32>().data();
    for (int64 i = 0; i < n; ++i) {
      if (slots[i] >= 0) *out++ = slots[i];
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("DynamicHeldSlots").Device(DEVICE_CPU), DynamicHeldSlotsOp);

// DynamicKeyedRows: each key's initial row (KeyedRows).
class DynamicKeyedRowsOp : public OpKernel {
 public:
  explicit DynamicKeyedRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string kind;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("kind", &kind));
    OP_REQUIRES_OK(ctx, KeyedRows::KindOf(kind, &kind_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &dim_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& keys_t = ctx->input(0);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(keys_t.shape()),
                errors::InvalidArgument("keys must be a vector, got ",
                                        keys_t.shape().DebugString()));
    KeyedRows rows;
    OP_REQUIRES_OK(ctx, KeyedRows::Of(kind_, dim_, ctx->input(1), ctx->input(2), &rows));
    const int64 n = keys_t.NumElements();
    Tensor* rows_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, dim_}), &rows_t));
    float* out = rows_t->flat<float>().data();
    const int64 dim = dim_;
    rows.Fill(ctx, keys_t.flat<int64>().data(), n, [out, dim](int64 i) { return out + i * dim; });
  }

 private:
  KeyedRows::Kind kind_;
  int64 dim_;
};

REGISTER_KERNEL_BUILDER(Name("DynamicKeyedRows").Device(DEVICE_CPU), DynamicKeyedRowsOp);

REGISTER_KERNEL_BUILDER(Name("DynamicFindOrInsert")
                            .Device(DEVICE_CPU)
                            .HostMemory("keys")
                            .HostMemory("call")
                            .HostMemory("slots")
                            .HostMemory("new_slots")
                            .HostMemory("new_keys"),
                        DynamicFindOrInsertOp);

}  // namespace tfhybrid
}  // namespace tensorflow
