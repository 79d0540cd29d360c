"""Decode raw little-endian int64 token ids with a tokenizer.json (for the round-trip test).

    python decode_tokens.py TOKENIZER_JSON TOKENS_BIN OUT_TXT
"""
import sys

import numpy as np
from tokenizers import Tokenizer

tok = Tokenizer.from_file(sys.argv[1])
ids = np.fromfile(sys.argv[2], dtype=np.int64).tolist()
with open(sys.argv[3], "w", encoding="utf-8") as f:
    f.write(tok.decode(ids, skip_special_tokens=False))
