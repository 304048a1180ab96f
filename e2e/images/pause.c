/*
 * meshgate's e2e pause image: the process that holds a pod sandbox's namespaces.
 *
 * It does what the Kubernetes pause container does, nothing more: as PID 1 of the pod it
 * reaps every child that is re-parented to it (SIGCHLD), exits 0 on SIGINT/SIGTERM so the
 * runtime can stop the sandbox quickly, and otherwise sleeps in pause(). Built static, so the
 * image needs no libc.
 */
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig) {
  (void)sig;
  _exit(0);
}

static void on_child(int sig) {
  (void)sig;
  /* Reap all exited children; several may exit before one signal is delivered. */
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction stop, child;
  memset(&stop, 0, sizeof stop);
  memset(&child, 0, sizeof child);
  stop.sa_handler = on_stop;
  child.sa_handler = on_child;
  child.sa_flags = SA_NOCLDSTOP | SA_RESTART;
  if (sigaction(SIGINT, &stop, NULL) < 0 || sigaction(SIGTERM, &stop, NULL) < 0 ||
      sigaction(SIGCHLD, &child, NULL) < 0) {
    return 1;
  }
  for (;;) {
    pause();
  }
  return 0;
}
