"""Input: feature specs, the TFRecord pipeline, and TFRecord writing."""
