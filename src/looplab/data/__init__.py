"""Data: synthetic reasoning tasks (p-hop, Mano) and language-model corpora."""
