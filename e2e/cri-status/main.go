// cri-status asks a CRI runtime for its verbose status and prints the CNI part as JSON:
// {"cniconfig": <the runtime's loaded CNI config>, "lastCNILoadStatus": "..."}.
// meshgate's real-node tests compare it with `meshgate-agent check`'s effective config file.
// Usage: cri-status UNIX_SOCKET_PATH
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: cri-status UNIX_SOCKET_PATH")
		os.Exit(2)
	}
	conn, err := grpc.NewClient("unix://"+os.Args[1], grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintln(os.Stderr, "cri-status:", err)
		os.Exit(1)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := runtimeapi.NewRuntimeServiceClient(conn).Status(ctx, &runtimeapi.StatusRequest{Verbose: true})
	if err != nil {
		fmt.Fprintln(os.Stderr, "cri-status:", err)
		os.Exit(1)
	}
	out := map[string]json.RawMessage{}
	if c, ok := resp.Info["cniconfig"]; ok {
		out["cniconfig"] = json.RawMessage(c)
	}
	status, _ := json.Marshal(resp.Info["lastCNILoadStatus"])
	out["lastCNILoadStatus"] = status
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fmt.Fprintln(os.Stderr, "cri-status:", err)
		os.Exit(1)
	}
}
