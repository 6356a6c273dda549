#!/bin/sh
# Regenerates the committed Python stubs (needs grpcio-tools):
#   host/switchagg/_proto/            the job service (proto/switchagg/jobs.proto)
#   controller/switchagg_controller/_p4rt/  P4Runtime, from a p4lang/p4runtime checkout's proto/ dir ($1)
# The PyPI `p4runtime` wheel ships pre-3.19 generated code that modern protobuf refuses to load,
# so the controller carries its own stubs; imports are rewritten to live under our packages.
set -eu
cd "$(dirname "$0")/.."
out=host/switchagg/_proto
python -m grpc_tools.protoc -I proto --python_out=$out --pyi_out=$out --grpc_python_out=$out switchagg/jobs.proto
mv $out/switchagg/jobs_pb2.py $out/switchagg/jobs_pb2.pyi $out/switchagg/jobs_pb2_grpc.py $out/
rmdir $out/switchagg
sed -i 's/^from switchagg import jobs_pb2/from switchagg._proto import jobs_pb2/' $out/jobs_pb2_grpc.py
if [ $# -ge 1 ]; then
  p4=controller/switchagg_controller/_p4rt
  python -m grpc_tools.protoc -I "$1" --python_out=$p4 --pyi_out=$p4 --grpc_python_out=$p4 \
    p4/v1/p4runtime.proto p4/v1/p4data.proto p4/config/v1/p4info.proto p4/config/v1/p4types.proto
  find $p4 -name '*.py' -o -name '*.pyi' | xargs sed -i -E \
    's/^from p4\.(v1|config\.v1) import/from switchagg_controller._p4rt.p4.\1 import/'
  for d in $p4 $p4/p4 $p4/p4/v1 $p4/p4/config $p4/p4/config/v1; do touch $d/__init__.py; done
fi
