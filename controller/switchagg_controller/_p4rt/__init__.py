"""P4Runtime Python bindings, generated with grpcio-tools from the p4lang/p4runtime protos (Apache-2.0).

They are committed because the PyPI ``p4runtime`` package's generated code no longer loads with
protobuf >= 4; regenerate with proto/generate.sh.
"""
