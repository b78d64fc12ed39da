"""`servesim report`: one self-contained HTML page for a result directory (to be written)."""
