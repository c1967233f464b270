"""How far a query row's valid slots reach, found by the CTA that walks the row (``skip_tail``).

``ROW_SCAN_PRELUDE`` is CUDA source for a program's prelude. Causal rows and the first tokens of packed
sequences hold -1 after their few keys, so a kernel stops a row at its last valid slot. Instead of a pass over
the indices before the launch (``common.indices.row_blocks``: a few small launches and a second read of the
indices), every thread of the CTA reads every ``kThreads``-th slot of its row (coalesced) and keeps the largest
(slot + 1) holding an entry >= 0; each warp's maximum goes to ``last_w[warp]``; after the CTA's barrier, every
thread takes the largest of them and rounds it up to whole blocks. Entries past the keys count as valid here
(they are masked in the walk, so an extra block of them changes no bit).
"""

ROW_SCAN_PRELUDE = r"""
template <int kThreads>
__device__ __forceinline__ void dsa_row_last_scan(const int* row, int kp, int* last_w) {
  int last = 0;
  for (int j = threadIdx.x; j < kp; j += kThreads) last = row[j] >= 0 ? j + 1 : last;
  last = __reduce_max_sync(0xffffffffu, last);
  if ((threadIdx.x & 31) == 0) last_w[threadIdx.x >> 5] = last;
}
template <int kThreads>
__device__ __forceinline__ int dsa_row_blocks(const int* last_w, int block) {
  int last = last_w[0];
  #pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) last = max(last, last_w[w]);
  return (last + block - 1) / block;
}
"""
