"""``cudasnap demo``: a small training job killed and resumed under the supervisor (runner),
and the training script it runs (train)."""
