#!/bin/sh
# Regenerates the committed job-service stubs in host/switchagg/_proto/ from proto/switchagg/jobs.proto.
# Use grpcio-tools 1.81.x: its bundled protobuf gencode is 6.x, which the protobuf runtime that
# finsy needs (>=6.33.6,<7) loads; a newer grpcio-tools emits 7.x gencode that protobuf 6 refuses.
#   python -m venv /tmp/gt && /tmp/gt/bin/pip install grpcio-tools==1.81.1 && PY=/tmp/gt/bin/python proto/generate.sh
# The P4Runtime messages come from finsy (finsy.proto), not from stubs of our own.
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-python}
out=host/switchagg/_proto
$PY -m grpc_tools.protoc -I proto --python_out=$out --pyi_out=$out --grpc_python_out=$out switchagg/jobs.proto
mv $out/switchagg/jobs_pb2.py $out/switchagg/jobs_pb2.pyi $out/switchagg/jobs_pb2_grpc.py $out/
rmdir $out/switchagg
sed -i 's/^from switchagg import jobs_pb2/from switchagg._proto import jobs_pb2/' $out/jobs_pb2_grpc.py
