"""A stand-in for Study B's two replicas: each a prefix cache of whole chunks, and, ON, a shared pool."""

import asyncio

from kvpool.engine.client import RequestResult


class StandIn:
    """Two replicas with a prefix cache each and, when ``pooled``, a shared pool of whole chunks; greedy
    answers are a function of the prompt (so ON and OFF agree) unless ``damage`` corrupts pool loads."""

    def __init__(self, chunk: int, pooled: bool, damage: bool = False, output_tokens: int = 4):
        self.chunk, self.pooled, self.damage, self.output_tokens = chunk, pooled, damage, output_tokens
        self.local = {0: set(), 1: set()}
        self.pool = set()
        self.sent = []

    async def send(self, replica: int, prompt: list[int]):
        self.sent.append((replica, len(prompt)))
        self.in_flight = getattr(self, "in_flight", 0) + 1
        self.most = max(getattr(self, "most", 0), self.in_flight)
        await asyncio.sleep(0.001)  # let concurrent requests overlap
        self.in_flight -= 1
        prefixes = range(self.chunk, len(prompt), self.chunk)
        local = max((n for n in prefixes if tuple(prompt[:n]) in self.local[replica]), default=0)
        external = 0
        if self.pooled:
            external = max((n for n in prefixes if tuple(prompt[:n]) in self.pool), default=0)
            external = max(external - local, 0)
        for n in prefixes:
            self.local[replica].add(tuple(prompt[:n]))
            if self.pooled:
                self.pool.add(tuple(prompt[:n]))
        answer = [sum(prompt) % 997 + i for i in range(self.output_tokens)]
        if self.damage and external:
            answer[0] += 1
        ttft = 0.01 + (len(prompt) - local - external) * 1e-4
        result = RequestResult(ttft_s=ttft, e2e_s=ttft + 0.03 * (self.output_tokens - 1),
                               prompt_tokens=len(prompt), cached_tokens=local + external,
                               output_text=" ".join(map(str, answer)), output_token_ids=answer)
        return result, {"local_cache_hit": local, "external_kv_transfer": external,
                        "local_compute": len(prompt) - local - external}
