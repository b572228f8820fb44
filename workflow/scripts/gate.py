from kvpool.measure import logs
from kvpool.report import gate

logs.to_log(snakemake.log[0])
gate.gate(snakemake.input.get("validity") or None, snakemake.input.get("kv_bytes") or None, snakemake.output[0],
          load_csv=snakemake.input.get("load") or None,
          studyb_json=snakemake.input.get("studyb") or None, peer_csv=snakemake.input.get("peer") or None,
          routers_csv=snakemake.input.get("routers") or None, contexts_csv=snakemake.input.get("contexts") or None,
          capacity_csv=snakemake.input.get("capacity") or None,
          trace_csv=snakemake.input.get("trace") or None)
