#!/bin/sh
# Regenerates the committed stubs in host/switchagg/_proto/ from proto/switchagg/*.proto (the job
# service, and the software aggregator's control service).
# Use grpcio-tools 1.81.x: its bundled protobuf gencode is 6.x, which the protobuf runtime that
# finsy needs (>=6.33.6,<7) loads; a newer grpcio-tools emits 7.x gencode that protobuf 6 refuses.
#   python -m venv /tmp/gt && /tmp/gt/bin/pip install grpcio-tools==1.81.1 && PY=/tmp/gt/bin/python proto/generate.sh
# The P4Runtime messages come from finsy (finsy.proto), not from stubs of our own.
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-python}
out=host/switchagg/_proto
for name in jobs aggregator; do
    $PY -m grpc_tools.protoc -I proto --python_out=$out --pyi_out=$out --grpc_python_out=$out switchagg/$name.proto
    mv $out/switchagg/${name}_pb2.py $out/switchagg/${name}_pb2.pyi $out/switchagg/${name}_pb2_grpc.py $out/
    sed -i "s/^from switchagg import ${name}_pb2/from switchagg._proto import ${name}_pb2/" $out/${name}_pb2_grpc.py
done
rmdir $out/switchagg
