from kvpool.measure import logs
from kvpool.report import studyb

logs.to_log(snakemake.log[0])
blocks = {name: {"csv": csv, "meta": meta}
          for name, csv, meta in zip(snakemake.params.blocks, snakemake.input.csvs, snakemake.input.metas, strict=True)}
studyb.run_studyb_tables(snakemake.params.settings, snakemake.params.study, blocks,
                         locality_csv=snakemake.output.locality,
                         sessions_csv=snakemake.output.sessions, summary_csv=snakemake.output.summary,
                         validity_out=snakemake.output.validity, windows_csv=snakemake.output.windows,
                         md_out=snakemake.output.md, figures_dir=snakemake.output.figures,
                         missing=snakemake.params.missing)
