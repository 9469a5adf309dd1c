"""GPT-2's byte -> printable character table: the alphabet of byte-level BPE vocabularies (the ByteLevel
pre-tokenizer and decoder of Hugging Face tokenizers), shared by the scripts that build or read such vocabularies."""


def bytes_to_unicode():
    """{byte: the character that stands for it in the vocabulary's token strings}."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))
