// Op registrations for tfhybrid's fused embedding ops.
//
//   EmbeddingLookupCombine          params (tensor) + ids + row_splits -> combined rows
//   ResourceEmbeddingLookupCombine  same, params read in place from a resource variable
//   ResourceEmbeddingLookupCombineConcat
//                                   several tables' bags side by side in one output
//   EmbeddingLookupCombineGrad      backward: unique sorted ids + coalesced gradient rows
//   RowwiseAdagradApply             sparse exact row-wise Adagrad (FBGEMM semantics)
//   EmbeddingLookupCombineGradRowwiseAdagrad
//                                   the backward and RowwiseAdagradApply in one kernel
//   TfhybridKernelIsa               which instruction-set level the kernels above use
//   ChunkedEmbeddingLookup          FIITED: rows of a chunk pool (row offsets), zeros past
//                                   each row's chunks
//   ChunkedEmbeddingLookupCombine   FIITED: bags of those rows summed
//   ChunkedRowwiseAdagradApply      FIITED: row-wise Adagrad on the chunks rows hold
//   CachedChunkedRowwiseAdagradApply  the same on a tiered FIITED table's cache
//
// Kernels live in ../kernels/. The Python wrappers and gradients are in
// tfhybrid/custom_ops/__init__.py.

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

// The attrs of every op that takes a lookup's ids and bags (the lookups, their backward
// and the fused backward + AdaGrad), so that they agree on the types and combiners.
#define TFHYBRID_LOOKUP_ATTRS                               \
  .Attr("Tindices: {int32, int64}")                         \
      .Attr("Tsplits: {int32, int64}")                      \
      .Attr("combiner: {'none', 'sum', 'mean'} = 'sum'")    \
      .Attr("table_name: string = 'embedding'")

// The backward ops' window on their upstream gradient: [] (all of its columns) or
// [begin, end), when several tables' bags share one output (the Concat lookup).
#define TFHYBRID_GRAD_COLUMNS_ATTR .Attr("grad_columns: list(int) = []")

namespace tensorflow {

using shape_inference::DimensionHandle;
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

namespace {

// Shared by the tensor and resource forms once `params` is known ([R, D]).
Status LookupCombineOutputShape(InferenceContext* c, ShapeHandle params) {
  ShapeHandle ids;
  ShapeHandle splits;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &ids));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &splits));
  TF_RETURN_IF_ERROR(c->WithRank(params, 2, &params));
  std::string combiner;
  TF_RETURN_IF_ERROR(c->GetAttr("combiner", &combiner));
  DimensionHandle d = c->Dim(params, 1);
  if (combiner == "none") {
    c->set_output(0, c->Matrix(c->Dim(ids, 0), d));
    return OkStatus();
  }
  DimensionHandle b = c->UnknownDim();
  if (c->ValueKnown(c->Dim(splits, 0))) {
    TF_RETURN_IF_ERROR(c->Subtract(c->Dim(splits, 0), 1, &b));
  }
  c->set_output(0, c->Matrix(b, d));
  return OkStatus();
}

}  // namespace

REGISTER_OP("EmbeddingLookupCombine")
    .Input("params: T")
    .Input("ids: Tindices")
    .Input("row_splits: Tsplits")
    .Input("weights: float")
    .Output("output: T")
    .Attr("T: {float, half, bfloat16}")
    TFHYBRID_LOOKUP_ATTRS
    .SetShapeFn([](InferenceContext* c) {
      return LookupCombineOutputShape(c, c->input(0));
    })
    .Doc(R"doc(
Fused embedding lookup + per-bag combine on CPU.

params: [R, D] embedding table.
ids: [nnz] row ids, every id must be in [0, R).
row_splits: [B + 1] bag boundaries (ragged row_splits); ignored for combiner='none'.
weights: [] (none) or [nnz] per-id weights, combiner 'sum' only: bag b is then the sum of
  weights[p] * params[ids[p]] (a weighted mean or sqrtn divides it afterwards).
output: combiner 'sum'/'mean' -> [B, D] (mean of an empty bag is 0);
  combiner 'none' -> [nnz, D] (plain gather).
table_name: used in error messages.
)doc");

REGISTER_OP("ResourceEmbeddingLookupCombine")
    .Input("params: resource")
    .Input("ids: Tindices")
    .Input("row_splits: Tsplits")
    .Input("weights: float")
    .Output("output: dtype")
    .Attr("dtype: {float, half, bfloat16}")
    TFHYBRID_LOOKUP_ATTRS
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle params = c->UnknownShapeOfRank(2);
      auto* handle_data = c->input_handle_shapes_and_types(0);
      if (handle_data != nullptr && !handle_data->empty()) {
        params = (*handle_data)[0].shape;
      }
      return LookupCombineOutputShape(c, params);
    })
    .Doc(R"doc(
EmbeddingLookupCombine reading the table in place from a resource variable
(shared lock, no copy of the table; like ResourceGather).
)doc");

REGISTER_OP("ResourceEmbeddingLookupCombineConcat")
    .Input("params: N * resource")
    .Input("ids: N * Tindices")
    .Input("row_splits: N * Tsplits")
    .Output("output: dtype")
    .Attr("N: int >= 1")
    .Attr("dtype: {float, half, bfloat16}")
    .Attr("Tindices: {int32, int64}")
    .Attr("Tsplits: {int32, int64}")
    .Attr("combiner: {'sum', 'mean'} = 'sum'")
    .Attr("table_names: list(string)")
    .Attr("widths: list(int)")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      int n;
      std::vector<int64_t> widths;
      TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
      TF_RETURN_IF_ERROR(c->GetAttr("widths", &widths));
      if (static_cast<int>(widths.size()) != n) {
        return errors::InvalidArgument("widths has ", widths.size(), " values, expected ", n);
      }
      int64_t width = 0;
      DimensionHandle b = c->UnknownDim();
      for (int t = 0; t < n; ++t) {
        ShapeHandle unused, splits;
        TF_RETURN_IF_ERROR(c->WithRank(c->input(n + t), 1, &unused));
        TF_RETURN_IF_ERROR(c->WithRank(c->input(2 * n + t), 1, &splits));
        width += widths[t];
        if (c->ValueKnown(c->Dim(splits, 0))) {
          DimensionHandle bags;
          TF_RETURN_IF_ERROR(c->Subtract(c->Dim(splits, 0), 1, &bags));
          TF_RETURN_IF_ERROR(c->Merge(b, bags, &b));
        }
      }
      c->set_output(0, c->Matrix(b, c->MakeDim(width)));
      return OkStatus();
    })
    .Doc(R"doc(
N tables' ResourceEmbeddingLookupCombine side by side: output[:, columns of table t] is
table t's [B, D_t] bags, in table order (FBGEMM's table-batched bags). Every table
needs the same number of bags. Each table's backward is EmbeddingLookupCombineGrad
(or the fused AdaGrad) with grad_columns set to its columns of the upstream gradient.

table_names: one per table, for error messages.
widths: D_t of each table (checked against the variables): its columns are known when
  the graph is built, for the backward's grad_columns.
)doc");

REGISTER_OP("EmbeddingLookupCombineGrad")
    .Input("grad: T")
    .Input("ids: Tindices")
    .Input("row_splits: Tsplits")
    .Input("num_rows: int64")
    .Input("weights: float")
    .Output("unique_ids: Tindices")
    .Output("grad_rows: T")
    .Attr("T: {float, half, bfloat16}")
    TFHYBRID_LOOKUP_ATTRS
    TFHYBRID_GRAD_COLUMNS_ATTR
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle grad, unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &grad));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 0, &unused));
      std::vector<int64_t> columns;
      TF_RETURN_IF_ERROR(c->GetAttr("grad_columns", &columns));
      DimensionHandle u = c->UnknownDim();
      c->set_output(0, c->Vector(u));
      c->set_output(1, c->Matrix(u, columns.size() == 2 ? c->MakeDim(columns[1] - columns[0])
                                                         : c->Dim(grad, 1)));
      return OkStatus();
    })
    .Doc(R"doc(
Backward of EmbeddingLookupCombine with duplicate ids coalesced.

grad: [B, D] for 'sum'/'mean', [nnz, D] for 'none'; with grad_columns [begin, end),
  its columns [begin, end) are the D read (the rest is another table's).
unique_ids: [U] distinct ids, sorted ascending.
grad_rows: [U, D]; row u is the sum over the positions p with ids[p] == unique_ids[u]
  (in increasing p) of the upstream gradient of p's bag (divided by the bag size for
  'mean', times weights[p] with weights). Accumulated in float32; deterministic for any
  thread count.
weights: the lookup's per-id weights ([] for none).
)doc");

REGISTER_OP("RowwiseAdagradApply")
    .Input("var: resource")
    .Input("accum: resource")
    .Input("indices: Tindices")
    .Input("grad: Tgrad")
    .Input("lr: float")
    .Input("epsilon: float")
    .Input("scale: float")
    .Input("weight_decay: float")
    .Attr("Tindices: {int32, int64}")
    .Attr("Tgrad: {float, half, bfloat16}")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle indices, grad, unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &indices));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 2, &grad));
      DimensionHandle n;
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(indices, 0), c->Dim(grad, 0), &n));
      for (int i = 4; i < 8; ++i) {
        TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
      }
      auto* var_data = c->input_handle_shapes_and_types(0);
      if (var_data != nullptr && !var_data->empty()) {
        ShapeHandle var;
        TF_RETURN_IF_ERROR(c->WithRank((*var_data)[0].shape, 2, &var));
        DimensionHandle d;
        TF_RETURN_IF_ERROR(c->Merge(c->Dim(var, 1), c->Dim(grad, 1), &d));
      }
      return OkStatus();
    })
    .Doc(R"doc(
Sparse exact row-wise Adagrad (FBGEMM EXACT_ROWWISE_ADAGRAD), in place.

var: float32 [R, D] resource; accum: float32 [R] resource.
indices: [N] (duplicates allowed; they are summed first, in input order).
For each distinct row i with summed gradient g (float32):
  accum[i] += mean_j(g_j^2)
  var[i] -= lr * g / (sqrt(accum[i] / scale) + epsilon)
  if weight_decay > 0: var[i] -= lr * weight_decay * var[i]   (after the step)
)doc");

REGISTER_OP("EmbeddingLookupCombineGradRowwiseAdagrad")
    .Input("var: resource")
    .Input("accum: resource")
    .Input("grad: float")
    .Input("ids: Tindices")
    .Input("row_splits: Tsplits")
    .Input("lr: float")
    .Input("epsilon: float")
    .Input("scale: float")
    .Input("weight_decay: float")
    .Input("weights: float")
    TFHYBRID_LOOKUP_ATTRS
    TFHYBRID_GRAD_COLUMNS_ATTR
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle grad, unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 2, &grad));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 1, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(4), 1, &unused));
      for (int i = 5; i < 9; ++i) {
        TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
      }
      return OkStatus();
    })
    .Doc(R"doc(
EmbeddingLookupCombineGrad(grad, ids, row_splits) followed by RowwiseAdagradApply on its
(unique_ids, grad_rows), in one pass and bitwise equal to the two: the gradient rows
are summed straight into the update instead of being written out and read back.

var: float32 [R, D] resource (the looked-up table); accum: float32 [R] resource.
grad: float32 [B, D] for 'sum'/'mean' (the lookup's upstream gradient), [nnz, D] for
  'none'; with grad_columns, the window read as in EmbeddingLookupCombineGrad.
weights: the lookup's per-id weights ([] for none).
)doc");

REGISTER_OP("ChunkedEmbeddingLookup")
    .Input("pool: float")
    .Input("row_offsets: int32")
    .Input("ids: Tindices")
    .Output("rows: float")
    .Attr("Tindices: {int32, int64}")
    .Attr("dim: int >= 1")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle pool, offsets, ids;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &pool));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &offsets));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &ids));
      int64_t dim;
      TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
      c->set_output(0, c->Matrix(c->Dim(ids, 0), dim));
      return OkStatus();
    })
    .Doc(R"doc(
Rows of a FIITED chunk pool (tfhybrid.fiited.ChunkedTable).

pool: float32 [S, dim / C]; row r's chunks are pool[row_offsets[r] .. row_offsets[r + 1]).
rows[n] = row ids[n]'s chunks, then zeros up to dim.
)doc");

REGISTER_OP("ChunkedEmbeddingLookupCombine")
    .Input("pool: resource")
    .Input("row_offsets: int32")
    .Input("ids: Tindices")
    .Input("row_splits: int64")
    .Input("weights: float")
    .Output("sums: float")
    .Attr("Tindices: {int32, int64}")
    .Attr("dim: int >= 1")
    .Attr("table_name: string = 'embedding'")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle offsets, ids, splits;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &offsets));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &ids));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 1, &splits));
      int64_t dim;
      TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
      DimensionHandle bags;
      TF_RETURN_IF_ERROR(c->Subtract(c->Dim(splits, 0), 1, &bags));
      c->set_output(0, c->Matrix(bags, dim));
      return OkStatus();
    })
    .Doc(R"doc(
Bags of rows of a FIITED chunk pool, summed (tfhybrid.fiited.ChunkedTable.lookup_combine).

pool: the pool variable, float32 [S, dim / C], read in place.
sums[b] = the sum over ids[row_splits[b] .. row_splits[b + 1]) of each id's row (its
chunks, then zeros up to dim), in id order. The gradient with respect to the table is
EmbeddingLookupCombineGrad's (it does not depend on how the rows are stored).
)doc");

REGISTER_OP("ChunkedRowwiseAdagradApply")
    .Input("pool: resource")
    .Input("accum: resource")
    .Input("row_offsets: int32")
    .Input("indices: Tindices")
    .Input("grad: float")
    .Input("lr: float")
    .Input("epsilon: float")
    .Input("scale: float")
    .Input("weight_decay: float")
    .Input("utility: resource")
    .Input("utility_decay: float")
    .Input("utility_weight: float")
    .Attr("Tindices: {int32, int64}")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 1, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(4), 2, &unused));
      return OkStatus();
    })
    .Doc(R"doc(
Exact row-wise Adagrad on a FIITED chunk pool, in place.

Duplicate indices are summed first (input order). For each distinct row i with summed
float32 gradient g ([dim]) and h = the entries its chunks hold:
  accum[i] += mean over its h entries of g^2
  its h entries -= lr * g / (sqrt(accum[i] / scale) + epsilon), then weight decay
utility (FIITED's per-row signal, float32 [rows]): every entry *= utility_decay, then each
distinct row's += utility_weight * |g|^2 (all dim entries).
)doc");

REGISTER_OP("CachedChunkedRowwiseAdagradApply")
    .Input("cache: resource")
    .Input("accum: resource")
    .Input("slot_chunks: int32")
    .Input("slot_rows: int64")
    .Input("indices: Tindices")
    .Input("grad: float")
    .Input("lr: float")
    .Input("epsilon: float")
    .Input("scale: float")
    .Input("weight_decay: float")
    .Input("utility: resource")
    .Input("utility_decay: float")
    .Input("utility_weight: float")
    .Attr("chunk_dim: int >= 1")
    .Attr("Tindices: {int32, int64}")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      for (int i : {2, 3, 4}) TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 1, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(5), 2, &unused));
      return OkStatus();
    })
    .Doc(R"doc(
ChunkedRowwiseAdagradApply on a tiered FIITED table's cache, in place.

cache: float32 [slots, dim]; slot i holds row slot_rows[i] of the table, whose first
slot_chunks[i] * chunk_dim entries it keeps (the rest are zeros and stay zeros). indices
are cache slots; accum has one entry per slot; utility one per row of the table (it
decays everywhere, and slot i's row gains as in ChunkedRowwiseAdagradApply). A row
updates here exactly as it would in a pool.
)doc");

REGISTER_OP("TfhybridKernelIsa")
    .Output("isa: string")
    .Output("supported: string")
    // Reads the CPU and TFHYBRID_KERNEL_ISA: never constant-folded into a saved graph.
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      c->set_output(1, c->Vector(c->UnknownDim()));
      return OkStatus();
    })
    .Doc(R"doc(
The instruction-set level of the embedding kernels' hot loops in this process.

isa: "generic", "avx2" or "avx512": the best level this CPU supports, or the lower one
  named by the environment variable TFHYBRID_KERNEL_ISA (read once per process; an
  invalid value or a level the CPU lacks is an InvalidArgument error).
supported: the levels this CPU supports with this build, lowest first.
)doc");

}  // namespace tensorflow
