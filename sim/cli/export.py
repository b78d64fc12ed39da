"""`servesim export`: a run's results in other tools' formats (to be written)."""
