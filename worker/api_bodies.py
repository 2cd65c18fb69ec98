"""The worker API's request bodies (docs/worker-api.md), as pydantic models that
refuse unknown fields and wrong types, and the one-line error body.

Checks that need the model (ids inside the vocabulary, prompt shorter than the
context) are the engine's (``LLMEngine.add_request``); everything a body can
get wrong on its own is refused here, before anything reaches the engine.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator

from kvserving.tags import NUM_TAGS

HASH_MAX = (1 << 63) - 1  # page hashes are 63-bit (page_pool.HASH_BITS)

TokenId = Annotated[StrictInt, Field(ge=0)]
Tag = Annotated[StrictInt, Field(ge=0, le=NUM_TAGS - 1)]
Number = StrictInt | StrictFloat


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class SamplingBody(_Body):
    max_tokens: StrictInt = Field(default=16, ge=1)
    temperature: Number = Field(default=0.0, ge=0.0)
    top_p: Number = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(default=0, ge=0)
    seed: StrictInt | None = None
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=1024)
    ignore_eos: StrictBool = False


class KVTransferParamsBody(_Body):
    """Where a prompt's KV may be pulled from (docs/worker-api.md, kv_transfer_params)."""

    engine_id: StrictStr = Field(min_length=1, max_length=256)
    agent_url: StrictStr = Field(min_length=1, max_length=2048)
    lease_id: StrictStr = Field(min_length=1, max_length=256)
    page_ids: list[Annotated[StrictInt, Field(ge=0)]]
    page_hashes: list[Annotated[StrictInt, Field(ge=0, le=HASH_MAX)]]
    num_tokens: StrictInt = Field(ge=0)
    page_size: StrictInt = Field(ge=1)
    dtype: StrictStr
    layout_hash: StrictStr
    expires_at: Number
    bits_cut: Number | None = Field(default=None, ge=0, le=NUM_TAGS)
    bits_ranking: StrictStr | None = Field(default=None, min_length=1, max_length=64)

    @model_validator(mode="after")
    def _pages_line_up(self) -> KVTransferParamsBody:
        if (self.bits_cut is None) != (self.bits_ranking is None):
            raise ValueError("bits_cut and bits_ranking come together or not at all")
        if len(self.page_ids) != len(self.page_hashes):
            raise ValueError(f"page_ids has {len(self.page_ids)} entries but page_hashes has {len(self.page_hashes)}")
        if self.num_tokens > len(self.page_ids) * self.page_size:
            raise ValueError(f"num_tokens {self.num_tokens} is more than {len(self.page_ids)} pages hold")
        return self


class GenerateBody(_Body):
    request_id: StrictStr = Field(min_length=1, max_length=256)
    input_ids: list[TokenId] = Field(min_length=1)
    tags: list[Tag] | None = None
    sampling: SamplingBody = Field(default_factory=SamplingBody)
    kv_transfer_params: KVTransferParamsBody | None = None
    conversation_key: StrictStr | None = Field(default=None, min_length=1, max_length=512)
    retain: StrictBool = False
    # The tenant (docs/worker-api.md): its pages match only requests with the same salt
    cache_salt: StrictStr | None = Field(default=None, min_length=1, max_length=256)
    # Tokens of the reply already generated elsewhere (the prefill worker's first
    # token, streamed to the client by the gateway): KV computed after input_ids,
    # counted in completion_tokens and max_tokens, not streamed again.
    output_ids: list[TokenId] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_tag_per_token(self) -> GenerateBody:
        if self.tags is not None and len(self.tags) != len(self.input_ids):
            raise ValueError(f"tags has {len(self.tags)} entries for {len(self.input_ids)} input_ids")
        return self


class RenewBody(_Body):
    ttl_s: Number | None = Field(default=None, gt=0.0)


class HoldBody(_Body):
    """``POST /internal/kv/leases/{id}/hold``: pin a lease's pages for one READ (``KVTransfer.hold``)."""

    digest: StrictStr = Field(min_length=1, max_length=128)
    hold_s: Number = Field(gt=0.0)
    consume: StrictBool = False


def error_body(message: str, *, type_: str, code: str | None = None) -> dict[str, Any]:
    """``{"error": {...}}`` with a one-line message (docs/worker-api.md)."""
    return {"error": {"message": " ".join(message.split()), "type": type_, "code": code}}


def validation_message(errors: list[Any]) -> str:
    """One line from pydantic's error list: ``field.path: reason; ...`` (at most three)."""
    parts = []
    for err in errors[:3]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        msg = str(err.get("msg", "invalid"))
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx", {}).get("error", "")
            return f"request body is not valid JSON: {ctx}".strip()
        parts.append(f"{loc}: {msg}" if loc else msg)
    more = f" (+{len(errors) - 3} more)" if len(errors) > 3 else ""
    return "; ".join(parts) + more
