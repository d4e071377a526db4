"""What the methods share on and around the wire, apart from the algorithms: the collective
messages a reduction yields and their scopes (``collectives``), one payload framed from
many pieces (``framing``), a payload entropy-coded for its gather (``entropy``), b-bit value
codes (``sparse_values``), the random keys every rank derives alike (``seeding``), the error
memory keyed by parameter name (``memory``), the tensors sent whole beside a compressed
payload (``whole``)."""
