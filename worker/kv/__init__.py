"""The worker's KV cache and its transfer between workers: the page pool, the storage, the
per-sequence manager, leases, and the puller that READs a prompt's pages from a peer."""
