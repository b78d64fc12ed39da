"""Many runs: sweeps (`sweep`, `sweep_file`, `workers`), comparisons (`compare`), independent
replications (`replications`), capacity searches under SLOs (`capacity`, `capacity_log`,
`rate_decision`) and their progress display (`progress`).
"""
