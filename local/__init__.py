"""Local mode: the whole product as child processes on loopback (``kvserving up``)
and the agent-conversation demo that runs on it (``kvserving demo``)."""
