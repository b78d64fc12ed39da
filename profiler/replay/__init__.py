"""Closing the loop: serving a scenario's requests for real, in real time (`serve`, with the
`executor` and its KV `blocks`), then `validate`: simulating the same requests with a fitted
profile (`validate_profile`) and saying how far apart the two are (`agreement`, `report`).
"""
