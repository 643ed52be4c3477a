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
    "quantize_int8": "Per row (last dimension), in float32: scale = amax(|w|) / 127 (keepdim); codes = "
    "round(w / scale) clamped to [-127, 127], as int8; a zero row gets scale 0 and codes 0.",
    "dequantize_int8": "codes.float() * scale.",
    "pack_4bit": "Flatten; byte i = 16 * code[2i] + code[2i+1] (the first code in the high four bits), "
    "uint8; "
    "unpack_4bit gives (byte // 16, byte % 16) per byte, in that order.",
    "quantize_nf4": "Pad the flattened float32 weights with zeros to whole blocks; per block absmax; code = "
    "the index of the NF4 value nearest to w / absmax; store only pack_4bit(codes) and the float32 absmax.",
    "dequantize_nf4": "NF4_VALUES[unpacked code] * the scale of its block, padding dropped, reshaped; the "
    "values the codes hold, not the original weights.",
    "attention_step": "Project only x_new; split heads (B, T, H, h) -> (B, H, T, h); cat the past k, v in "
    "front (dim 2); new token i at position T_past + i sees keys 0..T_past + i; softmax; o_proj.",
    "generate": "Greedy: argmax of the last position's logits. With the cache: the prompt once, then only "
    "the newest token with the past the previous step returned.",
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
