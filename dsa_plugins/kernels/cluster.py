"""Device helpers for CTAs that work as one cluster (Hopper thread-block clusters), shared by the kernel families.

``CLUSTER_PRELUDE`` is CUDA source for a program's prelude: the cluster-wide barrier (release / acquire, so that
shared-memory writes before it are visible to every peer after it), the address of a variable in a peer CTA's
shared memory, and 32-bit loads and atomic adds there (distributed shared memory). The asm is volatile with a
memory clobber so that no access moves across the barrier.

A cluster program calls ``dsa_grid_dependency_wait`` before it touches global memory: TileLang (0.1.15) launches
every cluster program with programmatic stream serialization, which lets it start as the previous kernel's CTAs
exit, before that kernel's global writes are guaranteed visible; ``griddepcontrol.wait`` waits for them (a no-op
when the launch did not allow the overlap).
"""

CLUSTER_PRELUDE = r"""
__device__ __forceinline__ void dsa_grid_dependency_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

__device__ __forceinline__ void dsa_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// the cluster shared-memory address of the variable at shared-memory address saddr in CTA `rank`
__device__ __forceinline__ unsigned dsa_peer_saddr(unsigned saddr, unsigned rank) {
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(saddr), "r"(rank));
  return r;
}

// the same for a generic pointer to this CTA's shared memory
__device__ __forceinline__ unsigned dsa_peer_addr(const void* p, int rank) {
  return dsa_peer_saddr(static_cast<unsigned>(__cvta_generic_to_shared(p)), rank);
}

__device__ __forceinline__ int dsa_peer_i32(const void* p, int rank) {
  int v;
  asm volatile("ld.shared::cluster.b32 %0, [%1];" : "=r"(v) : "r"(dsa_peer_addr(p, rank)) : "memory");
  return v;
}

// atomically adds v to the int at p in CTA `rank`'s shared memory; returns the value before
__device__ __forceinline__ int dsa_peer_add_i32(const void* p, int rank, int v) {
  int old;
  asm volatile("atom.shared::cluster.add.u32 %0, [%1], %2;" : "=r"(old) : "r"(dsa_peer_addr(p, rank)), "r"(v)
               : "memory");
  return old;
}
"""
