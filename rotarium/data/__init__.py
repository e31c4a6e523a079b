"""Training and evaluation data, below both: the ``data`` config section (:mod:`rotarium.data.config`), documents
(:mod:`rotarium.data.documents`), tokenizers (:mod:`rotarium.data.tokenizer`), and packed sequences and batches
(:mod:`rotarium.data.batches`)."""
