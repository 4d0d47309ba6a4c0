"""burncoll: backend-agnostic collective operations."""
