"""Anvil's Llama-family pretraining trainer (never imports Invoke or Fabric)."""
