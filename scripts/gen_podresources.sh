#!/usr/bin/env bash
# Regenerates the kubelet pod-resources stubs (collectors/attribution/podresources_v1/)
# from the kubelet's api.proto beside them, with grpcio-tools (the `test` extra):
#   scripts/gen_podresources.sh      (uses .venv/bin/python, else python3)
# The generated files are committed; the import of api_pb2 in api_pb2_grpc is made
# relative, as they live inside the ac_observe package.
set -euo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python; [ -x "$python" ] || python=python3
dir=collectors/attribution/podresources_v1
"$python" -m grpc_tools.protoc -I "$dir" --python_out="$dir" --pyi_out="$dir" \
    --grpc_python_out="$dir" "$dir/api.proto"
sed -i 's/^import api_pb2 as api__pb2$/from . import api_pb2 as api__pb2/' "$dir/api_pb2_grpc.py"
