// The ops of dynamic tables (tfhybrid/dynamic/): DynamicFindOrInsert, one shard's batched
// find-or-insert of keys, which also writes the new keys' rows. Its kernel, and the rules
// it follows, are in ../kernels/dynamic_table_kernels.cc; the Python wrappers are in
// tfhybrid/custom_ops/dynamic.py.

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {

using shape_inference::InferenceContext;

REGISTER_OP("DynamicFindOrInsert")
    .Input("slot_keys: resource")
    .Input("slot_seen: resource")
    .Input("slot_count: resource")
    .Input("index: resource")
    .Input("cand_keys: resource")
    .Input("cand_seen: resource")
    .Input("cand_count: resource")
    .Input("cand_index: resource")
    .Input("counters: resource")
    .Input("rows: resource")
    .Input("accumulator: resource")
    .Input("keys: int64")
    .Input("call: int64")
    .Input("seed: int64")
    .Input("bounds: double")
    .Output("slots: int32")
    .Output("new_slots: int32")
    .Output("new_keys: int64")
    .Attr("admit_after: int >= 1 = 1")
    .Attr("evict: {'lfu', 'lru', 'none'} = 'lfu'")
    .Attr("ttl: int >= 0 = 0")
    .Attr("pinned: int >= 1 = 1")
    .Attr("insert: bool = true")
    .Attr("init: {'constant', 'uniform', 'normal'} = 'constant'")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(11));
      c->set_output(1, c->Vector(c->UnknownDim()));
      c->set_output(2, c->Vector(c->UnknownDim()));
      return OkStatus();
    })
    .Doc(R"doc(
One call of a dynamic table's shard on `keys`: the slot of each key (-1: not admitted),
and the slots that took a new key in this call, with those keys. Those slots' rows get
their keys' initial rows (as DynamicKeyedRows gives them) and their accumulators zero.

slot_keys, slot_seen: int64 [capacity], slot_count: int32 [capacity]: each slot's key,
  the call that last saw it (-1: free) and its sightings (saturating at 2**31 - 1).
  index: int32 [buckets], a power of two at least twice the capacity, -1 where empty.
  cand_*: the same for admission candidates (any size with admit_after 1). counters:
  int64 [8]: admissions, evictions, refusals, hits, misses, live slots, the first
  never-used slot, live candidates. rows: float32 [capacity, dim], accumulator: float32
  [capacity]: the table's rows and row-wise accumulators. call: this call's number,
  larger than every earlier one. seed, bounds, init: the initializer, as
  DynamicKeyedRows' seed, bounds and kind ('constant': every entry is bounds[0]).
admit_after: sightings before a key gets a slot. evict: which row makes room when the
  shard is full ('none': refuse the key). ttl: free slots unseen for more than ttl calls
  (0: never). pinned: slots seen in the last `pinned` calls are never evicted. insert:
  false only finds keys, changing nothing (inference).
)doc");

REGISTER_OP("DynamicHeldSlots")
    .Input("slots: int32")
    .Input("lengths: int64")
    .Output("held: int32")
    .Output("held_per_bag: int64")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->input(1));
      return OkStatus();
    })
    .Doc(R"doc(
Of bags of slots (lengths[b] slots each, in order), the slots >= 0 (the keys a dynamic
table holds), in order, and how many each bag keeps.
)doc");

REGISTER_OP("DynamicKeyedRows")
    .Input("keys: int64")
    .Input("seed: int64")
    .Input("bounds: double")
    .Output("rows: float")
    .Attr("kind: {'uniform', 'normal'}")
    .Attr("dim: int >= 1")
    .SetShapeFn([](InferenceContext* c) {
      int64_t dim;
      TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
      c->set_output(0, c->Matrix(c->Dim(c->input(0), 0), dim));
      return OkStatus();
    })
    .Doc(R"doc(
The initial row of each of a dynamic table's keys, a function of (seed, key) only:
tfhybrid/dynamic/initial_rows.py's formula (splitmix64's stream, computed in float64 and
rounded to float32). seed: the table seed's 64 bits; bounds: [low, high] in float64.
kind 'uniform': low + (high - low) u; 'normal': Box-Muller with mean low and standard
deviation high. keys: [n]; rows: [n, dim].
)doc");

}  // namespace tensorflow
