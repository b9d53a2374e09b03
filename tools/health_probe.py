#!/usr/bin/python3
"""gRPC health probe (grpc.health.v1.Health/Check) for moe-rankd and moe-controller.

  health_probe.py TARGET [SERVICE]

TARGET is a gRPC target ("unix:/path/0.sock", "127.0.0.1:50051"); SERVICE is the service whose
readiness to ask ("moe.v1.ExpertLayerService": a rank serving steps), or none for the whole server
(liveness). Prints the status; exits 0 for SERVING, 1 for NOT_SERVING or UNKNOWN, 2 when the
server cannot be asked. The messages are encoded by hand (one string field, one enum field), so
only grpcio is needed, not the health-checking package.
"""
import sys

import grpc

STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def encode_request(service: str) -> bytes:
    name = service.encode()
    if len(name) > 127:
        raise ValueError("service name longer than 127 bytes")
    return (b"\x0a" + bytes([len(name)]) + name) if name else b""


def decode_status(body: bytes) -> int:
    # HealthCheckResponse { ServingStatus status = 1; }: absent means 0 (UNKNOWN).
    if len(body) >= 2 and body[0] == 0x08:
        return body[1]
    return 0


def main(argv):
    if len(argv) not in (2, 3):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    target, service = argv[1], argv[2] if len(argv) == 3 else ""
    with grpc.insecure_channel(target) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        try:
            body = check(encode_request(service), timeout=5)
        except grpc.RpcError as e:
            print("%s: %s" % (e.code().name, e.details()))
            return 2
    status = decode_status(body)
    print(STATUS.get(status, str(status)))
    return 0 if status == 1 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
