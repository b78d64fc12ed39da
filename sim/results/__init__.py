"""What a run leaves: records turned into column tables (`records`, `columns`), the run directory
and reading result directories back (`run_dir`, `read`, `outdir`), names and units
(`labels`), what a result depends on (`fingerprint`), and the statistics (`metrics`).
"""
