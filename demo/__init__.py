"""`ddiloco demo`: a real multi-process run with a chaos monkey; the reference learner process; full replay."""
