"""What the methods share on and around the wire, apart from the algorithms: collective messages,
framing, entropy coding, b-bit value codes, shared random keys, error memory, tensors sent whole."""
