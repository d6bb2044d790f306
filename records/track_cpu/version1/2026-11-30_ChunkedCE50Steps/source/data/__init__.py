"""Token shards, the offline GPT-2 tokenizer, the FineWeb download and the tiny offline corpus."""
