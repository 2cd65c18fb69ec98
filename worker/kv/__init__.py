"""The worker's KV cache and its transfer between workers, lowest layer first::

page_pool   page ids, ref counts, free list, prefix hashes, LRU, pins (pure Python)
storage     the bytes: one uint8 buffer per layer, page layouts, global scales
manager     sequences -> pages: prefix match, page precision, allocation
cache       builds the three for an engine (``build_kv_cache``)
scales      measuring the global K/V scales
leases      what keeps pages past their request (lease, hold, admission pin)
            and the lease store over the pool's pins (pure Python)
protocol    ``kv_transfer_params``, the layout identity, the peer HTTP client
nixl_io     NIXL READs of a peer's pages (the only module that imports NIXL)
puller      a prompt's pages from a peer: plan -> hold -> READ -> adopt
transfer    ``KVTransfer``: one worker's connector, the puller and the lease store
local_pair  a prefill and a decode worker in one process (CPU benchmarks)
"""
