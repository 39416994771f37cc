"""Adapters for other libraries, each in its own module and importing that library only when
used (none of them is a dependency of structattn):

* :mod:`structattn.integrations.huggingface`: structured heads in the self-attention of a
  Hugging Face ``transformers`` BERT / RoBERTa-style model (``pip install structattn[hf]``).
"""
