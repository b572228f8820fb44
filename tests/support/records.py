"""A cell's records as the pipeline writes them, small enough to read: four documents of 2,410 tokens
(not whole chunks), their populate and reuse rows and the split-matched reference they are judged by."""

import pandas as pd

DOC = 2410  # not whole chunks: a pool hit ends at the document's last whole chunk of 256, 2304 tokens
POOL_SPLIT = 2304
STORED_CHUNKS = 4 * POOL_SPLIT // 256 + 2  # populate's pool: every document's whole chunks and the preflight's two
OWN_CACHE_SPLIT = 2400  # vLLM's own cache reuses the document's whole blocks of 16


def reference_rows(pool=("a", "b", "c", "d"), cold=tuple("wxyz"), after=tuple("pqrs")):
    """A split-matched reference as kvpool.measure.reference.compute writes it: per follow-up, cold (split 0), the
    document's whole chunks (the pool's split) and the document (vLLM's own cache, its whole blocks)."""
    rows = []
    for doc in range(4):
        key = f"doc{doc}/followup0"
        rows += [{"key": key, "doc_id": doc, "followup": 0, "path": "cold", "requested_split": 0, "achieved_split": 0,
                  "output_text": cold[doc], "error": ""},
                 {"key": key, "doc_id": doc, "followup": 0, "path": "pool_chunks", "requested_split": POOL_SPLIT,
                  "achieved_split": POOL_SPLIT, "output_text": pool[doc], "error": ""},
                 {"key": key, "doc_id": doc, "followup": 0, "path": "after_document", "requested_split": DOC,
                  "achieved_split": OWN_CACHE_SPLIT, "output_text": after[doc], "error": ""}]
    return pd.DataFrame(rows)


def frames(arm="shared", hits=POOL_SPLIT, errors=("",) * 4, outputs=None, local=0, populate_hits=(0,) * 4):
    """``populate_hits``: per document, the tokens its populate request loaded from a pool (0: prefilled cold)."""
    outputs = outputs or (("a", "b", "c", "d") if arm == "shared" else tuple("wxyz"))
    populate = pd.DataFrame({"doc_id": range(4), "prefill_replica": [0, 1, 0, 1], "serve_replica": [0, 1, 0, 1],
                             "external_hit_tokens": list(populate_hits), "error": [""] * 4, "output_text": ["x"] * 4})
    reuse = pd.DataFrame({"doc_id": range(4), "prefill_replica": [0, 1, 0, 1], "serve_replica": [1, 0, 1, 0],
                          "ttft_s": [0.1, 0.2, 0.3, 0.4], "external_hit_tokens": [hits] * 4,
                          "cached_tokens": [hits + local] * 4, "local_cache_hit_tokens": [local] * 4,
                          "error": list(errors), "output_text": list(outputs)})
    return populate, reuse, reference_rows()
