"""Conversations to samples to shards: stages 00-03."""
