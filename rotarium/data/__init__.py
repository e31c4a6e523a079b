"""Training and evaluation data, below both: the ``data`` config section (:mod:`rotarium.data.config`), documents
(:mod:`rotarium.data.documents`), tokenizers (:mod:`rotarium.data.tokenizer`), packed sequences and batches
(:mod:`rotarium.data.batches`), prepared folders (written by :mod:`rotarium.data.prepared_writer`, read by
:mod:`rotarium.data.prepared_reader`, both importable from :mod:`rotarium.data.prepared`), the training loaders, one
interface for a source read whole, a prepared folder and a stream (:mod:`rotarium.data.loader`), and streams read by
shards without preparing (:mod:`rotarium.data.stream`)."""
