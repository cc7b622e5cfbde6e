"""The stages of a run (data, capture, train, export, eval), each with its inputs, outputs and
fingerprint (stage.py: what the runner sees of one), and what they share (context.py); dflash/pipeline.py runs
them."""
