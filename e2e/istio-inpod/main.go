// istio-inpod writes istio-cni's ambient in-pod redirection into the network namespace it
// runs in, with istio's own rule builders at the pinned version (istio.io/istio
// cni/pkg/iptables and cni/pkg/nftables, AppendInpodRules), for the pod-level overrides the
// node agent would derive from the annotations given. meshgate's integration tests run it
// inside a test namespace and judge what it wrote.
//
// Usage: istio-inpod --backend iptables-nft|iptables-legacy|nftables [--annotations JSON]
// [--redirect-dns=false]. It prints the rules it applied (iptables-restore input, or the
// nft transaction) and exits non-zero on any failure.
package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"strings"

	"istio.io/api/annotation"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"istio.io/istio/cni/pkg/config"
	"istio.io/istio/cni/pkg/iptables"
	"istio.io/istio/cni/pkg/nftables"
	"istio.io/istio/cni/pkg/nodeagent"
	"istio.io/istio/cni/pkg/util"
	dep "istio.io/istio/tools/istio-iptables/pkg/dependencies"
)

func main() {
	backend := flag.String("backend", "", "iptables-nft, iptables-legacy or nftables")
	annotations := flag.String("annotations", "{}", "the pod's annotations, a JSON object of strings")
	redirectDNS := flag.Bool("redirect-dns", true, "the node agent's REDIRECT_DNS (its chart's default: true)")
	flag.Parse()
	if err := run(*backend, *annotations, *redirectDNS); err != nil {
		fmt.Fprintf(os.Stderr, "istio-inpod: %v\n", err)
		os.Exit(1)
	}
}

func run(backend, annotationsJSON string, redirectDNS bool) error {
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "ns"}}
	if err := json.Unmarshal([]byte(annotationsJSON), &pod.Annotations); err != nil {
		return fmt.Errorf("--annotations: %w", err)
	}
	cfg := &config.AmbientConfig{
		RedirectDNS:            redirectDNS,
		HostProbeSNATAddress:   nodeagent.HostProbeSNATIP,
		HostProbeV6SNATAddress: nodeagent.HostProbeSNATIPV6,
	}
	overrides := podLevelOverrides(pod)
	switch backend {
	case "iptables-nft", "iptables-legacy":
		_, pod, err := iptables.NewIptablesConfigurator(cfg, cfg, &dep.RealDependencies{}, &dep.RealDependencies{}, iptables.RealNlDeps())
		if err != nil {
			return err
		}
		restore := pod.AppendInpodRules(overrides).BuildV4Restore()
		fmt.Print(restore)
		cmd := exec.Command(backend+"-restore", "--noflush")
		cmd.Stdin = strings.NewReader(restore)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("%s-restore: %w: %s", backend, err, stderr.String())
		}
		return nil
	case "nftables":
		_, pod, err := nftables.NewNftablesConfigurator(cfg, cfg, nil, nil, iptables.RealNlDeps())
		if err != nil {
			return err
		}
		tx, err := pod.AppendInpodRules(overrides)
		if tx != nil {
			fmt.Print(tx.String())
		}
		return err
	default:
		return fmt.Errorf("--backend must be iptables-nft, iptables-legacy or nftables, not %q", backend)
	}
}

// podLevelOverrides is the node agent's getPodLevelTrafficOverrides (cni/pkg/nodeagent/net.go,
// unexported there), step by step with the same helpers.
func podLevelOverrides(pod *corev1.Pod) config.PodLevelOverrides {
	out := config.PodLevelOverrides{IngressMode: false, DNSProxy: config.PodDNSUnset}
	if ingress, present := util.CheckBooleanAnnotation(pod, annotation.AmbientBypassInboundCapture.Name); present {
		out.IngressMode = ingress
	}
	if dns, present := util.CheckBooleanAnnotation(pod, annotation.AmbientDnsCapture.Name); present {
		if dns {
			out.DNSProxy = config.PodDNSEnabled
		} else {
			out.DNSProxy = config.PodDNSDisabled
		}
	}
	if virt, has := pod.Annotations[annotation.IoIstioRerouteVirtualInterfaces.Name]; has {
		for _, v := range strings.Split(virt, ",") {
			if t := strings.TrimSpace(v); t != "" {
				out.VirtualInterfaces = append(out.VirtualInterfaces, t)
			}
		}
	}
	return out
}
