"""Agent traffic as data: the seeded agent population every load and simulation draws from
(``load``) and the KV page mix of agent contexts it yields (``pages``)."""
