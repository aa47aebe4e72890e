"""The paged KV cache: the page pool (ref counts, prefix hashes, LRU), per-request page tables, the prefix
index, the K/V tensors, their device page tables, CPU offload and the memory plan."""
