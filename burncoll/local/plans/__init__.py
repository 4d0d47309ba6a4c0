"""The plans of local operations: one decision (:mod:`.choose`) picks a typed plan per
operation, and each kind of plan (one module each) prepares what the local peers share and runs
each peer's part."""
