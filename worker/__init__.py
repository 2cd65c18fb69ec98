"""The inference engine a prefill/decode pod runs: model code, KV pool, scheduler, server, NIXL transfer."""
