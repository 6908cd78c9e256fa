"""The engine side of the gateway's request ids, shared by both engine loops (the engine process's
`EngineLoop` and the in-process `InProcEngineClient`): one place that turns protocol messages into
Engine calls and Engine outputs into updates (`step_batch`: the engine process's wire message, plain token
updates in its columns; `step`: every update as a `RequestUpdate`, for the in-process engine).

Bookkeeping it owns:
  * `rids` / `names`: the gateway's request id (a string) <-> the engine's (an int), for live requests;
  * `pinned`: name -> engine rid of `pin=True` requests until their owner unpins them. An Unpin can
    arrive at any time: before the request finished (then the engine will not pin it at all), after it
    (the pin goes), or after it was aborted or its pin was dropped by the cache (a no-op). Entries whose
    pin no longer exists are pruned, so the map stays as small as the live pins.
"""

from __future__ import annotations

from k3rt.protocol import GenerateRequest, RequestUpdate, UpdateBatch, params_from_dict


class RequestMap:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.rids: dict[str, int] = {}  # gateway rid -> engine rid (live requests)
        self.names: dict[int, str] = {}
        self.pinned: dict[str, int] = {}  # gateway rid -> engine rid of pin=True requests not yet unpinned

    def add(self, msg: GenerateRequest) -> RequestUpdate | None:
        """Queue the request; a rejected one is answered with a finished RequestUpdate naming the field."""
        try:
            if msg.rid in self.rids or msg.rid in self.pinned:
                raise ValueError(f"rid: {msg.rid!r} is already in use")
            rid = self.engine.add_request(msg.prompt_ids, params_from_dict(msg.params), cache_salt=msg.cache_salt,
                                          eos_token_ids=msg.eos_token_ids, grammar=msg.grammar,
                                          prompt_logprobs_from=msg.prompt_logprobs_from, pin=msg.pin)
        except (ValueError, TypeError, OverflowError) as e:
            return RequestUpdate(msg.rid, [], True, "error", len(msg.prompt_ids), error=str(e))
        self.rids[msg.rid], self.names[rid] = rid, msg.rid
        if msg.pin:
            self.pinned[msg.rid] = rid
        return None

    def abort(self, name: str) -> None:
        rid = self.rids.get(name)
        if rid is not None:
            self.engine.abort(rid)

    def unpin(self, name: str) -> None:
        rid = self.pinned.pop(name, None)
        if rid is not None:
            self.engine.unpin(rid)

    def flush(self) -> None:
        """Drop every cached prefix, pinned ones included (their programs recompute what they need)."""
        self.engine.flush_cache()
        self.pinned = {n: r for n, r in self.pinned.items() if r in self.engine.requests}

    def abort_all(self) -> None:
        for rid in self.rids.values():
            self.engine.abort(rid)

    def step(self) -> list[RequestUpdate]:
        """One engine step; the updates of the requests that advanced or ended (the in-process engine)."""
        return self.step_batch().expand()

    def step_batch(self) -> UpdateBatch:
        """One engine step as the wire message (stats left empty): an update that is new tokens only goes into
        the columns, any other (finished, logprobs, an error) is a whole RequestUpdate."""
        updates: list[RequestUpdate] = []
        names, rids, token_ids, prompt, cached, spec = self.names, [], [], [], [], []
        for o in self.engine.step():
            name = names.get(o.rid)
            if name is None:
                continue
            if not o.finished and o.logprobs is None and o.top_logprobs is None and o.error is None:
                rids.append(name)
                token_ids.append(o.new_token_ids)
                prompt.append(o.prompt_len)
                cached.append(o.cached_tokens)
                spec.append(o.spec_accepted_tokens)
                continue
            plp = None if o.prompt_logprobs is None else {str(k): v for k, v in o.prompt_logprobs.items()}
            ptop = None if o.prompt_top_logprobs is None else {str(k): v for k, v in o.prompt_top_logprobs.items()}
            updates.append(RequestUpdate(name, o.new_token_ids, o.finished, o.finish_reason, o.prompt_len,
                                         o.cached_tokens, o.logprobs, o.top_logprobs, error=o.error,
                                         prompt_logprobs=plp, prompt_top_logprobs=ptop,
                                         spec_accepted_tokens=o.spec_accepted_tokens))
            if o.finished:
                del self.rids[name], self.names[o.rid]
                if name in self.pinned and not self.engine.is_pinned(o.rid):
                    del self.pinned[name]  # aborted, failed, or unpinned while it ran: nothing to release
        if len(self.pinned) > 2 * self.engine.num_pins + 64:  # pins the cache dropped (cap, flush)
            self.pinned = {n: r for n, r in self.pinned.items()
                           if r in self.engine.requests or self.engine.is_pinned(r)}
        return UpdateBatch(updates, {}, rids, token_ids, prompt, cached, spec)
