"""Course models: one transformer (``transformer``) under BERT (``bert``) and a decoder LM.

Lecture 9 adds, imported on demand (``from minidist.models import generate``): ``shards``
(safetensors checkpoints with an index), ``pretrained`` (the course's small trained decoder,
cached), ``generate`` (KV cache, incremental greedy decoding) and ``lora`` (LoRA, prompt tuning).

Also: ``score_bias`` (ALiBi and masks), ``pretrain`` (BERT MLM, one process), ``checkpointing``,
``stages`` and ``tp_decoder`` (the decoder cut for pipeline and tensor parallelism),
``zero_training`` (lecture 8's ZeRO run), ``bert_experiments`` and ``bert_compression``
(lecture 6). ::

    from minidist.models import bert, decoder
    model = bert.BertForMLM(bert.CONFIGS["mini"])
    with torch.device("meta"):
        lm = decoder.DecoderLM(decoder.CONFIGS["bloom-176b"])   # shapes only, no memory
"""

from minidist.models import bert, decoder, transformer

__all__ = ["bert", "decoder", "transformer"]
