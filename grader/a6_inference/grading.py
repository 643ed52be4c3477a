"""How ``python -m grader grade`` runs assignment 6: the hidden tests as jobs plus trusted checks.

Each ``Case`` of ``cases.cases(seed)`` becomes a ``Job`` (a worker of ``workers.py``, one
process, JSON arguments with seeds only this run knows) that the sandbox runs, and the case's
check, which runs here on the report read back as JSON and ``.npy``: the formats and the decoder
(``reference.py``) are recomputed here from the same arguments. The sandbox gets ``workers.py``
and ``rules.py`` only: never ``cases.py``, ``reference.py``, the expected values or the
points.
"""

from __future__ import annotations

from grader.assignment import Assignment

#: the library files a submission is compared with (``grader/similarity.py``), relative to the root
SIMILAR_TO = ("lib/minidist/quant/*.py", "lib/minidist/models/generate/*.py")
#: functions the stub gives (every submission has them): not compared
GIVEN_FUNCTIONS = (
    "NF4Weight.nbytes",
    "NF4Weight.numel",
    "DecoderBlock.__init__",
    "TinyDecoder.__init__",
    # not given, but not compared either: their docstrings dictate the one line every correct
    # answer writes alike (the library's versions are the same tokens)
    "dequantize_int8",
    "unpack_4bit",
)

HINTS = {
    "quantize_int8": "Which value of a row maps to 127, what does a row of zeros give, and is the "
    "arithmetic in float32 whatever the input's dtype? (lecture 9 section 3.1)",
    "dequantize_int8": "Which dtype comes back, and does the scale broadcast over the row?",
    "pack_4bit": "Which code of a pair goes in the high four bits, and does unpack_4bit undo exactly "
    "that order?",
    "quantize_nf4": "Is the last block padded, is each code the nearest NF4 value to w / absmax, and is "
    "anything but the packed codes and the float32 scales stored? (QLoRA section 3)",
    "dequantize_nf4": "Do you return the values the codes hold (not the original weights), padding "
    "dropped, in the original shape?",
    "attention_step": "Are the projections called once, on the new tokens only; does new token i (at "
    "position T_past + i) see every earlier key and no later one; is the past first in the cache?",
    "generate": "Is the next token the argmax at the last position, and with the cache does every step "
    "after the prompt run only the newest token with the past the previous step returned?",
    "quantize_model": "Which matrices tolerate fewer bits, and what do the scales and codebooks cost at "
    "your block size? Measure the perplexity on the course's data before handing in (lecture 9 "
    "section 3).",
}

ASSIGNMENT = Assignment.of(
    __package__,
    hints=HINTS,
    similar_to=SIMILAR_TO,
    given_functions=GIVEN_FUNCTIONS,
    timeout=60,
    student_code="inference.py",
    deadlock_hint="An endless loop?",
    import_marker="import_module(",
    one_process=True,
)
