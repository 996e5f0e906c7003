// The paged-KV lookup every NVIDIA kernel makes: a block table's entry for a column, and the
// block id a kernel may read. Torch-free; used by the cuda kernels (BlockRow in
// attention_params.cuh) and the sm120 kernel.
//
// A block table is int32 [num_seqs, max_blocks_per_seq]; column c of sequence s holds the cache
// block of its tokens c * block_size .. (c + 1) * block_size - 1. An entry outside the cache's
// [0, num_blocks) (an engine's -1 padding, or garbage in columns the sequence does not reach) is
// never dereferenced: the kernels treat the keys it would hold as NaN, so exactly the rows that
// attend them come out NaN (CONTRACT.md section 3).
#pragma once
#include <cuda_runtime.h>

namespace turboquant {
namespace paged_kv {

// row's entry in column col: -1 past the table's max_blocks columns (never read there)
__device__ __forceinline__ int table_entry(const int* row, int col, int max_blocks) {
  return col < max_blocks ? __ldg(row + col) : -1;
}

// the cache block of column col: -1 past the table or outside the cache's [0, num_blocks)
__device__ __forceinline__ int block_id(const int* row, int col, int max_blocks, int num_blocks) {
  if (col >= max_blocks) return -1;
  const int b = __ldg(row + col);
  return (b < 0 || b >= num_blocks) ? -1 : b;
}

}  // namespace paged_kv
}  // namespace turboquant
