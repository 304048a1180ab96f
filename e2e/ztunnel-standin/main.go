// ztunnel-standin stands in for Istio's ztunnel on meshgate's real nodes, at exactly the points
// meshgate and istio-cni observe, and nowhere else:
//   - it CONNECTS to istio-cni's node agent on its ZDS socket (ztunnel's INPOD_UDS,
//     /var/run/ztunnel/ztunnel.sock), a SOCK_SEQPACKET unix socket, and speaks the ZDS protocol
//     with istio's own pkg/zdsapi messages: ZdsHello, then an Ack for every WorkloadRequest;
//   - for each pod it is handed (AddWorkload with the pod's netns fd over SCM_RIGHTS) it opens
//     TCP listeners on ztunnel's in-pod ports (15008 HBONE, 15006 plaintext inbound, 15001
//     outbound) INSIDE the pod's network namespace (setns on that fd), and closes them on
//     DelWorkload;
//   - it answers ztunnel's readiness probe (GET /healthz/ready on 15021) with 200 only while
//     it is connected and has acked the node agent's SnapshotSent.
// It proxies nothing: no HBONE, no certificates, no xDS. Written for meshgate's e2e tests
// (e2e/install-deps.sh builds it, e2e/images/build-istio-images.sh packages it).
//
// Usage: ztunnel-standin [SOCKET] [--ready-unconnected]
//   SOCKET               the node agent's socket (default /var/run/ztunnel/ztunnel.sock)
//   --ready-unconnected  report Ready and never connect: a ztunnel whose pod is Ready but that
//                        has not taken the node (what meshgate's "connected" check is for)
package main

import (
	"errors"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"istio.io/istio/pkg/zdsapi"
)

// ztunnel's in-pod listeners (istio/ztunnel: inbound HBONE, inbound plaintext, outbound).
var podPorts = []int{15008, 15006, 15001}

// The node agent acks within its readWriteDeadline; a message is far below this.
const maxMessage = 1024

type standin struct {
	mu        sync.Mutex
	listeners map[string][]net.Listener // by pod uid
	ready     atomic.Bool
}

func main() {
	socket := "/var/run/ztunnel/ztunnel.sock"
	unconnected := false
	for _, arg := range os.Args[1:] {
		if arg == "--ready-unconnected" {
			unconnected = true
		} else {
			socket = arg
		}
	}
	s := &standin{listeners: map[string][]net.Listener{}}
	go s.serveReadiness(":15021")
	if unconnected {
		log.Print("--ready-unconnected: Ready, and never connecting to the node agent")
		s.ready.Store(true)
		select {}
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-stop
		log.Print("terminating: closing every pod's listeners")
		s.ready.Store(false)
		s.closeAll()
		os.Exit(0)
	}()
	for {
		err := s.session(socket)
		s.ready.Store(false)
		log.Printf("session with the node agent ended: %v; reconnecting in 1s", err)
		time.Sleep(time.Second)
	}
}

func (s *standin) serveReadiness(addr string) {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz/ready", func(w http.ResponseWriter, _ *http.Request) {
		if s.ready.Load() {
			fmt.Fprintln(w, "ready")
			return
		}
		http.Error(w, "not connected to the node agent", http.StatusServiceUnavailable)
	})
	srv := &http.Server{Addr: addr, Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	log.Fatal(srv.ListenAndServe())
}

// session connects, says hello and serves requests until the connection fails.
func (s *standin) session(socket string) error {
	conn, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: socket, Net: "unixpacket"})
	if err != nil {
		return err
	}
	defer conn.Close()
	hello, err := proto.Marshal(&zdsapi.ZdsHello{Version: zdsapi.Version_V1})
	if err != nil {
		return err
	}
	if _, err := conn.Write(hello); err != nil {
		return fmt.Errorf("sending hello: %w", err)
	}
	log.Printf("connected to %s, hello sent", socket)
	buf := make([]byte, maxMessage)
	oob := make([]byte, unix.CmsgSpace(4))
	for {
		n, oobn, flags, _, err := conn.ReadMsgUnix(buf, oob)
		if err != nil {
			return err
		}
		if n == 0 {
			return errors.New("the node agent closed the connection")
		}
		if flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 {
			return errors.New("truncated message")
		}
		fd, err := receivedFd(oob[:oobn])
		if err != nil {
			return err
		}
		var req zdsapi.WorkloadRequest
		ackErr := ""
		if err := proto.Unmarshal(buf[:n], &req); err != nil {
			ackErr = "bad request: " + err.Error()
		} else {
			ackErr = s.handle(&req, fd)
		}
		if fd >= 0 {
			unix.Close(fd)
		}
		ack, err := proto.Marshal(&zdsapi.WorkloadResponse{
			Payload: &zdsapi.WorkloadResponse_Ack{Ack: &zdsapi.Ack{Error: ackErr}},
		})
		if err != nil {
			return err
		}
		if _, err := conn.Write(ack); err != nil {
			return fmt.Errorf("acking: %w", err)
		}
	}
}

// handle applies one request; returns the ack's error text ("" for success).
func (s *standin) handle(req *zdsapi.WorkloadRequest, fd int) string {
	switch p := req.Payload.(type) {
	case *zdsapi.WorkloadRequest_Add:
		w := p.Add.GetWorkloadInfo()
		if fd < 0 {
			return "add without a netns fd"
		}
		ls, err := listenIn(fd)
		if err != nil {
			log.Printf("add %s (%s/%s): %v", p.Add.Uid, w.GetNamespace(), w.GetName(), err)
			return err.Error()
		}
		s.mu.Lock()
		closeListeners(s.listeners[p.Add.Uid])
		s.listeners[p.Add.Uid] = ls
		s.mu.Unlock()
		log.Printf("add %s (%s/%s): listening on %v in its netns", p.Add.Uid, w.GetNamespace(), w.GetName(), podPorts)
	case *zdsapi.WorkloadRequest_Keep:
		log.Printf("keep %s", p.Keep.Uid)
	case *zdsapi.WorkloadRequest_Del:
		s.mu.Lock()
		closeListeners(s.listeners[p.Del.Uid])
		delete(s.listeners, p.Del.Uid)
		s.mu.Unlock()
		log.Printf("del %s: its listeners closed", p.Del.Uid)
	case *zdsapi.WorkloadRequest_SnapshotSent:
		s.ready.Store(true)
		log.Print("snapshot sent: ready")
	default:
		return "unknown request"
	}
	return ""
}

// receivedFd returns the one fd passed with a message, or -1.
func receivedFd(oob []byte) (int, error) {
	if len(oob) == 0 {
		return -1, nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return -1, err
	}
	for _, m := range msgs {
		fds, err := unix.ParseUnixRights(&m)
		if err != nil {
			continue
		}
		for _, extra := range fds[1:] {
			unix.Close(extra)
		}
		if len(fds) > 0 {
			return fds[0], nil
		}
	}
	return -1, nil
}

// listenIn opens the pod's listeners inside the netns `fd` names, from a thread of its own
// that enters it and comes back (a thread that cannot come back is left locked, so the Go
// runtime retires it).
func listenIn(fd int) ([]net.Listener, error) {
	type result struct {
		ls  []net.Listener
		err error
	}
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		own, err := unix.Open(fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid()), unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			runtime.UnlockOSThread()
			done <- result{err: fmt.Errorf("opening this thread's netns: %w", err)}
			return
		}
		defer unix.Close(own)
		if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			done <- result{err: fmt.Errorf("entering the pod's netns: %w", err)}
			return
		}
		var ls []net.Listener
		var lerr error
		for _, port := range podPorts {
			l, err := net.Listen("tcp", fmt.Sprintf(":%d", port))
			if err != nil {
				lerr = fmt.Errorf("listening on %d in the pod's netns: %w", port, err)
				break
			}
			ls = append(ls, l)
		}
		if err := unix.Setns(own, unix.CLONE_NEWNET); err == nil {
			runtime.UnlockOSThread()
		}
		if lerr != nil {
			closeListeners(ls)
			done <- result{err: lerr}
			return
		}
		done <- result{ls: ls}
	}()
	r := <-done
	for _, l := range r.ls {
		go drain(l)
	}
	return r.ls, r.err
}

// drain accepts and closes connections until the listener is closed: it proxies nothing.
func drain(l net.Listener) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		c.Close()
	}
}

func closeListeners(ls []net.Listener) {
	for _, l := range ls {
		l.Close()
	}
}

func (s *standin) closeAll() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for uid, ls := range s.listeners {
		closeListeners(ls)
		delete(s.listeners, uid)
	}
}
